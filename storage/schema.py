"""Arrow schemas of the MEG Store, as explicit constants.

Every column belongs to one of three groups, recorded in the field metadata under ``group``:

* ``meta``   -- who and what a row is: keys, graph position, provenance, time of writing;
* ``data``   -- what the agent produced and what was computed from it (tokens, text, reward);
* ``status`` -- where the row is in the training life cycle (consumed by which step).

Partition columns (``agent``, ``iteration``) are not stored in the files; they come from the
hive directory names (``agent=planner/iteration=3``) and are typed by an explicit partition
schema, because hive inference would turn an agent named ``"7"`` into an integer.
"""

from __future__ import annotations

import operator
import re

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

__all__ = [
    "AGENT_NAME_RE",
    "INPUT_FILE_SCHEMA",
    "INPUT_PARTITION_SCHEMA",
    "INPUT_READ_SCHEMA",
    "SAMPLE_FILE_SCHEMA",
    "SAMPLE_PARTITION_SCHEMA",
    "SAMPLE_READ_SCHEMA",
    "STATUS_FIELDS",
    "STATUS_FILE_SCHEMA",
    "derive_sample_ids",
    "partitioning",
    "validate_agent",
    "validate_iteration",
]


def _f(name: str, type_: pa.DataType, group: str, nullable: bool = True, doc: str = "") -> pa.Field:
    meta = {"group": group}
    if doc:
        meta["doc"] = doc
    return pa.field(name, type_, nullable=nullable, metadata=meta)


_TS = pa.timestamp("us", tz="UTC")

#: One row per (sample_id, policy_version): an agent's output at one node of the instantiated
#: MEG. ``reward``/``advantage``/``consumed_step`` are usually null when written by rollout and
#: filled later by status appends (folded in at read time and by compaction).
SAMPLE_FILE_SCHEMA = pa.schema(
    [
        _f("sample_id", pa.string(), "meta", False, "{input_id}:{traj}:{agent}:{turn}"),
        _f("input_id", pa.string(), "meta", False),
        _f("traj", pa.int32(), "meta", False, "trajectory index 0..G-1 within the input"),
        _f("turn", pa.int32(), "meta", False, "unrolled round of this agent in the trajectory"),
        _f("mb", pa.int32(), "meta", False, "micro-batch; groups whole inputs (all G trajs)"),
        _f("policy_version", pa.int64(), "meta", False, "weights version that produced it"),
        _f("parents", pa.list_(pa.string()), "meta", True, "sample_ids fed into the prompt"),
        _f("created_at", _TS, "meta", False, "set by the store; the latest write wins"),
        _f("prompt_ids", pa.list_(pa.int32()), "data"),
        _f("response_ids", pa.list_(pa.int32()), "data"),
        _f("logprobs", pa.list_(pa.float32()), "data", True, "per response token"),
        _f("loss_mask", pa.list_(pa.int8()), "data", True,
           "per response token: 1 sampled, 0 inserted by a tool (no behaviour logprob); "
           "null = all sampled (and every store written before tools)"),
        _f("token_versions", pa.list_(pa.int64()), "data", True,
           "per response token: the weights version that sampled it, when the sample spans a "
           "weight update (codesign.partial_rollouts); null = every token policy_version's"),
        _f("prompt_text", pa.string(), "data"),
        _f("response_text", pa.string(), "data"),
        _f("reward", pa.float64(), "data"),
        _f("advantage", pa.float32(), "data"),
        _f("value", pa.float32(), "data", True, "the critic's value of the sample's observation (gae)"),
        _f("token_values", pa.list_(pa.float32()), "data", True,
           "the critic's value before each response token (gae with critic.per_token)"),
        _f("extra", pa.string(), "data", True, "JSON object of user fields"),
        _f("consumed_step", pa.int64(), "status", True, "optimizer step that trained on it"),
    ]
)

#: Columns that status appends may set; each is folded as "latest non-null write wins".
STATUS_FIELDS: tuple[str, ...] = ("reward", "advantage", "value", "token_values", "consumed_step")

#: Append-only log of status changes for samples of one (agent, iteration).
STATUS_FILE_SCHEMA = pa.schema(
    [
        _f("sample_id", pa.string(), "meta", False),
        _f("policy_version", pa.int64(), "meta", False),
        _f("mb", pa.int32(), "meta", True, "micro-batch of the sample; lets mb reads skip files"),
        _f("created_at", _TS, "meta", False),
        _f("reward", pa.float64(), "data"),
        _f("advantage", pa.float32(), "data"),
        _f("value", pa.float32(), "data"),
        _f("token_values", pa.list_(pa.float32()), "data"),
        _f("consumed_step", pa.int64(), "status"),
    ]
)

#: The dataset prompts of one iteration.
INPUT_FILE_SCHEMA = pa.schema(
    [
        _f("input_id", pa.string(), "meta", False),
        _f("split", pa.string(), "meta", True, "train / eval / test"),
        _f("created_at", _TS, "meta", False),
        _f("text", pa.string(), "data"),
        _f("answer", pa.string(), "data", True, "reference answer for the reward function"),
        _f("meta", pa.string(), "data", True, "JSON object of user fields"),
    ]
)

SAMPLE_PARTITION_SCHEMA = pa.schema(
    [_f("agent", pa.string(), "meta", False), _f("iteration", pa.int64(), "meta", False)]
)
INPUT_PARTITION_SCHEMA = pa.schema([_f("iteration", pa.int64(), "meta", False)])

#: What ``MEGStore.read_samples`` returns: file columns (status folded in) + partition columns.
SAMPLE_READ_SCHEMA = pa.schema(list(SAMPLE_FILE_SCHEMA) + list(SAMPLE_PARTITION_SCHEMA))
INPUT_READ_SCHEMA = pa.schema(list(INPUT_FILE_SCHEMA) + list(INPUT_PARTITION_SCHEMA))


def partitioning(kind: str) -> ds.Partitioning:
    """Hive partitioning with explicit types, for ``pyarrow.dataset`` users.

    ``kind`` is ``"samples"``, ``"status"`` or ``"inputs"``.
    """
    if kind in ("samples", "status"):
        return ds.partitioning(SAMPLE_PARTITION_SCHEMA, flavor="hive")
    if kind == "inputs":
        return ds.partitioning(INPUT_PARTITION_SCHEMA, flavor="hive")
    raise ValueError(f"unknown table kind {kind!r}; expected 'samples', 'status' or 'inputs'")


# Names become directory names and hive values: no separators, no "=", and no leading "_" or
# "." (readers, DuckDB and pyarrow skip such paths as hidden).
AGENT_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")


def validate_agent(agent: object) -> str:
    if not isinstance(agent, str) or not AGENT_NAME_RE.fullmatch(agent):
        raise ValueError(
            f"invalid agent name {agent!r}: expected 1-128 characters of letters, digits, "
            "'_', '.', '-', not starting with '_', '.' or '-' (it becomes a directory name "
            "agent=<name>, so '/' and '=' are not allowed)"
        )
    return agent


def validate_iteration(iteration: object) -> int:
    try:
        value = operator.index(iteration)  # accepts numpy integers, rejects floats
    except TypeError:
        value = -1
    if isinstance(iteration, bool) or value < 0:
        raise ValueError(f"invalid iteration {iteration!r}: expected an int >= 0")
    return value


def derive_sample_ids(table: pa.Table, agent: str) -> pa.Array:
    """The sample_id each row of ``table`` must have: ``{input_id}:{traj}:{agent}:{turn}``."""
    return pc.binary_join_element_wise(
        table.column("input_id"),
        pc.cast(table.column("traj"), pa.string()),
        pa.scalar(agent),
        pc.cast(table.column("turn"), pa.string()),
        ":",
    )
