#!/bin/sh
# The compose stack's one-shot `init` service (compose/docker-compose.yml). Idempotent: each step
# is skipped when what it makes exists, so `docker compose up` again resumes a run.
#   1. the model in MILES_MODEL_DIR: the user's folder (the host's MILES_MODEL_DIR, mounted there;
#      MILES_INIT_USER_MODEL=yes) is used as it is; otherwise the tiny demo model and its
#      supervised warm start (`miles sft`) are built into the miles-model volume, config.json
#      last, so a half-built model is never taken for a model;
#   2. the trainer's Ed25519 key pair (`miles keys generate`) in miles-keys, and its public key
#      alone copied into miles-public, which producers and the evaluator mount;
#   3. the prompts (`miles feed`, MILES_FEED_EPOCHS epochs of MILES_PROMPTS) once per run: the
#      marker runs/RUN/.fed says they were (delete it, or use another MILES_RUN, to feed again).
# Its folders (the volumes' mount points) and settings come from the service's environment.
set -eu
MODEL="$MILES_MODEL_DIR"
KEYS="$MILES_KEYS_DIR"
PUBLIC="$MILES_PUBLIC_DIR"
RUN_DIR="$MILES_RUNS_DIR/$MILES_RUN"

if [ -f "$MODEL/config.json" ]; then
    echo "init: model in $MODEL"
elif [ -n "${MILES_INIT_USER_MODEL:-}" ]; then
    echo "init: MILES_MODEL_DIR holds no config.json (a Hugging Face model folder)" >&2
    exit 2
else
    echo "init: building the tiny model and its warm start ($MILES_SFT_STEPS SFT steps)"
    staging="$(mktemp -d)"
    miles sft --out "$staging/model" --prompts "$MILES_PROMPTS" --steps "$MILES_SFT_STEPS"
    for path in "$staging/model"/*; do
        [ "$(basename "$path")" = config.json ] || cp -r "$path" "$MODEL/"
    done
    cp "$staging/model/config.json" "$MODEL/config.json"
    rm -rf "$staging"
fi

if [ ! -f "$KEYS/control.key" ]; then
    miles keys generate "$KEYS"
fi
cp "$KEYS/control.pub" "$PUBLIC/control.pub"

mkdir -p "$RUN_DIR"
if [ -f "$RUN_DIR/.fed" ]; then
    echo "init: prompts of run $MILES_RUN were fed ($RUN_DIR/.fed)"
else
    miles feed --bus "$MILES_BUS" --run "$MILES_RUN" --prompts "$MILES_PROMPTS" \
        --epochs "$MILES_FEED_EPOCHS"
    touch "$RUN_DIR/.fed"
fi
echo "init: done"
