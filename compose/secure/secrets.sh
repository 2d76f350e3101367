#!/bin/sh
# compose/secure.yml's one-shot `kafka-secrets` service, on the apache/kafka image (it has the
# JDK's keytool; the Miles image has no JDK). Made once, kept on later `up`s:
#   - TLS as `miles broker start --secure` makes it (miles/broker_security.py, `_make_tls`): a
#     CA, the broker's PKCS12 keystore signed by it, a truststore; the broker's certificate names
#     `kafka` (the compose network), localhost, 127.0.0.1 and MILES_ADVERTISED_HOST;
#   - random passwords: admin (PLAIN on the internal and controller listeners, SCRAM for Miles'
#     ACL step) and one SCRAM user per role (trainer, producer, feeder, reader);
#   - the broker's whole server.properties (the image's "file input": /mnt/shared/config);
#   - per role, a folder with ca.pem and its password only, which only that role's services
#     mount (at MILES_ROLE_DIR); the admin's also holds every password (passwords/USER, for the
#     users step) and security.json, which `miles broker acls` reads.
# Folders: KAFKA_CONFIG_DIR, KAFKA_SECRETS_DIR (the broker's), MILES_KAFKA_DIR/<role>.
# Files are mode 644: the broker runs as the image's user, and each volume is mounted only by
# the services of its role.
set -eu
ROLES="trainer producer feeder reader"
if [ -f "$MILES_KAFKA_DIR/admin/security.json" ]; then
    echo "kafka-secrets: made before ($MILES_KAFKA_DIR/admin/security.json)"
    exit 0
fi
secret() { head -c 18 /dev/urandom | base64 | tr '+/' '-_'; }
STORE_PASSWORD="$(secret)"
ADMIN_PASSWORD="$(secret)"
TLS="$KAFKA_SECRETS_DIR"
NAMES="SAN=dns:kafka,dns:localhost,ip:127.0.0.1"
case "$MILES_ADVERTISED_HOST" in
    localhost|kafka) ;;
    *[!0-9.]*) NAMES="$NAMES,dns:$MILES_ADVERTISED_HOST" ;;
    *) NAMES="$NAMES,ip:$MILES_ADVERTISED_HOST" ;;
esac
STORE="-storetype PKCS12 -storepass $STORE_PASSWORD"
KEY="-keyalg RSA -keysize 2048 -validity 3650"
rm -f "$TLS"/*.p12 "$TLS"/*.pem "$TLS"/*.csr
keytool -genkeypair -alias ca -dname "CN=Miles compose CA" -ext bc:c $KEY -keystore "$TLS/ca.p12" $STORE
keytool -exportcert -rfc -alias ca -file "$TLS/ca.pem" -keystore "$TLS/ca.p12" $STORE
keytool -genkeypair -alias broker -dname "CN=kafka" -ext "$NAMES" $KEY -keystore "$TLS/broker.p12" $STORE
keytool -certreq -alias broker -file "$TLS/broker.csr" -keystore "$TLS/broker.p12" $STORE
keytool -gencert -alias ca -rfc -ext "$NAMES" -validity 3650 -infile "$TLS/broker.csr" \
    -outfile "$TLS/broker.pem" -keystore "$TLS/ca.p12" $STORE
keytool -importcert -noprompt -alias ca -file "$TLS/ca.pem" -keystore "$TLS/broker.p12" $STORE
keytool -importcert -noprompt -alias broker -file "$TLS/broker.pem" -keystore "$TLS/broker.p12" $STORE
keytool -importcert -noprompt -alias ca -file "$TLS/ca.pem" -keystore "$TLS/truststore.p12" $STORE
rm -f "$TLS/ca.p12" "$TLS/broker.csr"  # the CA's key signs nothing more

PLAIN="org.apache.kafka.common.security.plain.PlainLoginModule required username=\"admin\" password=\"$ADMIN_PASSWORD\" user_admin=\"$ADMIN_PASSWORD\";"
SCRAM="org.apache.kafka.common.security.scram.ScramLoginModule required;"
cat > "$KAFKA_CONFIG_DIR/server.properties" <<PROPERTIES
# Written by compose/secure/secrets.sh. Shared settings as in compose/docker-compose.yml.
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@kafka:29093
controller.listener.names=CONTROLLER
listeners=SASL_SSL_HOST://:9093,SASL_SSL://:19093,INTERNAL://:19094,CONTROLLER://:29093
advertised.listeners=SASL_SSL_HOST://$MILES_ADVERTISED_HOST:9093,SASL_SSL://kafka:19093,INTERNAL://kafka:19094
listener.security.protocol.map=SASL_SSL_HOST:SASL_SSL,SASL_SSL:SASL_SSL,INTERNAL:SASL_PLAINTEXT,CONTROLLER:SASL_PLAINTEXT
inter.broker.listener.name=INTERNAL
sasl.mechanism.inter.broker.protocol=PLAIN
sasl.mechanism.controller.protocol=PLAIN
listener.name.controller.sasl.enabled.mechanisms=PLAIN
listener.name.controller.plain.sasl.jaas.config=$PLAIN
listener.name.internal.sasl.enabled.mechanisms=PLAIN
listener.name.internal.plain.sasl.jaas.config=$PLAIN
listener.name.sasl_ssl.sasl.enabled.mechanisms=SCRAM-SHA-512,SCRAM-SHA-256
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=$SCRAM
listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config=$SCRAM
listener.name.sasl_ssl_host.sasl.enabled.mechanisms=SCRAM-SHA-512,SCRAM-SHA-256
listener.name.sasl_ssl_host.scram-sha-512.sasl.jaas.config=$SCRAM
listener.name.sasl_ssl_host.scram-sha-256.sasl.jaas.config=$SCRAM
ssl.keystore.type=PKCS12
ssl.keystore.location=$TLS/broker.p12
ssl.keystore.password=$STORE_PASSWORD
ssl.key.password=$STORE_PASSWORD
ssl.truststore.type=PKCS12
ssl.truststore.location=$TLS/truststore.p12
ssl.truststore.password=$STORE_PASSWORD
ssl.client.auth=none
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=false
super.users=User:admin
log.dirs=/var/lib/kafka/data
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
message.max.bytes=8454144
replica.fetch.max.bytes=8454144
PROPERTIES
cat > "$TLS/admin.properties" <<PROPERTIES
security.protocol=SASL_PLAINTEXT
sasl.mechanism=PLAIN
sasl.jaas.config=$PLAIN
PROPERTIES
chmod 644 "$KAFKA_CONFIG_DIR/server.properties" "$TLS"/*

write_role() {  # ROLE PASSWORD: the role's folder, and the password in the admin's list
    mkdir -p "$MILES_KAFKA_DIR/$1" "$MILES_KAFKA_DIR/admin/passwords"
    cp "$TLS/ca.pem" "$MILES_KAFKA_DIR/$1/ca.pem"
    printf '%s\n' "$2" > "$MILES_KAFKA_DIR/$1/password"
    printf '%s\n' "$2" > "$MILES_KAFKA_DIR/admin/passwords/$1"
}
write_role admin "$ADMIN_PASSWORD"
passwords="\"admin\": \"$ADMIN_PASSWORD\""
for role in $ROLES; do
    password="$(secret)"
    write_role "$role" "$password"
    passwords="$passwords, \"$role\": \"$password\""
done
# What `miles broker acls --data-dir` reads (miles/broker_security.py SecureSetup), with the
# paths the admin's folder has where Miles services mount it (MILES_ROLE_DIR).
cat > "$MILES_KAFKA_DIR/admin/security.json" <<JSON
{"bootstrap": "kafka:19093", "ca_file": "$MILES_ROLE_DIR/ca.pem",
 "passwords": {$passwords}, "store_password": "$STORE_PASSWORD", "internal_port": 19094}
JSON
echo "kafka-secrets: TLS for $NAMES, users admin $ROLES"
