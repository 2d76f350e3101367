#!/bin/sh
# compose/secure.yml's one-shot `kafka-users`, on the apache/kafka image once the broker is up:
# every SCRAM user (both mechanisms) from the admin's passwords/USER files, created as the super
# user `admin` over PLAIN on the internal listener (SCRAM users cannot exist before the broker
# serves: the image formats its own log). Idempotent: an alter replaces a user's credentials.
set -eu
for file in "$MILES_KAFKA_DIR"/passwords/*; do
    user="$(basename "$file")"
    password="$(cat "$file")"
    for mechanism in SCRAM-SHA-512 SCRAM-SHA-256; do  # one credential per request
        "$KAFKA_BIN/kafka-configs.sh" --bootstrap-server "$KAFKA_INTERNAL" \
            --command-config "$KAFKA_SECRETS_DIR/admin.properties" --alter \
            --entity-type users --entity-name "$user" --add-config "$mechanism=[password=$password]"
    done
done
echo "kafka-users: done"
