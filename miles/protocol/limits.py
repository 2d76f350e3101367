"""Named bounds of the wire format: every size, range and dtype a decoder enforces.

One module so the codec, the docs (`docs/wire-format.md`) and other-language clients agree on a
single list. Bounds are generous sanity guards against garbage and hostile input, not tuning
knobs; the real size bound of a record is `MAX_RECORD_BYTES` (from `topics`), which the msgpack
unpacker limits are derived from.
"""

import numpy as np

from miles.protocol.topics import MAX_RECORD_BYTES

SCHEMA_VERSION = (1, 4)
"""(major, minor) written into every record. Readers reject another major, accept any minor."""

TOKEN_DTYPE = np.dtype("<i4")
"""Token ids and per-token policy versions: little-endian int32."""

FLOAT_DTYPE = np.dtype("<f4")
"""Logprobs and per-token rewards: little-endian float32."""

MASK_DTYPE = np.dtype("|u1")
"""An episode's `loss_mask` (1.4): one unsigned byte per token, 0 or 1."""

OBSERVATION_VERSION = -1
"""The `versions` entry of an observation token (loss_mask 0, 1.4): no policy sampled it."""

MAX_TOKENS_PER_SEQUENCE = 1 << 20
"""Longest prompt or response (tokens) a record may declare."""

MAX_SAMPLES_PER_GROUP = 4096
"""Most samples in one `TrajectoryGroup`."""

MAX_MAP_ENTRIES = 1024
"""Most entries in a free-form scalar map (metadata, sampling, timings, extra)."""

MAX_EPISODE_ENTRIES = 16
"""Most entries in a sample's `episode` map (1.4): it comes with every sample, so the largest
valid group stays within `MAX_OBJECTS_PER_RECORD`."""

MAX_DEAD_LETTER_PAYLOAD_BYTES = 1 << 20
"""Rejected bytes kept in a `DeadLetter`; longer payloads are truncated (see `payload_size`)."""

MAX_VOCAB_SIZE = (1 << 31) - 1
"""Largest vocabulary: every token id must fit an int32."""

MAX_POLICY_VERSION = (1 << 31) - 1
"""Largest policy version: per-token versions travel as int32."""

MAX_GENERATION = (1 << 31) - 1
"""Largest trainer generation (one per trainer start on a run's out_dir)."""

SIGNATURE_BYTES = 64
"""Length of the Ed25519 `signature` of a control record (1.3)."""

# Range of every other integer on the wire (counts, offsets, byte sizes, scalar-map values).
INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1

MAX_OBJECTS_PER_RECORD = 1 << 18
"""Most msgpack objects in one record, counted as every map and array (at any depth, in known
or ignored fields) plus its entries and elements. The largest valid record, a group of
`MAX_SAMPLES_PER_GROUP` samples (~53 each: the sample map, its six array maps and a full
`episode` map) with full scalar maps, has ~220,000; 8 MiB of empty containers would be 8 million, seconds of decoding."""

# msgpack unpacker limits, checked on each length prefix before anything is built: no valid
# record has a longer array than `samples` or a bigger map than a free-form scalar map, so a
# forged or hostile container of any size costs nothing. Strings and bins are bounded by the
# record size.
UNPACK_LIMITS = {
    "max_str_len": MAX_RECORD_BYTES,
    "max_bin_len": MAX_RECORD_BYTES,
    "max_array_len": MAX_SAMPLES_PER_GROUP,
    "max_map_len": MAX_MAP_ENTRIES,
    "max_ext_len": 0,  # no ext types (this also rejects msgpack timestamps)
}
