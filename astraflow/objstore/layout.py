"""``RunLayout``: every bucket key of a run, built in one place (see ARCHITECTURE.md, bucket layout).

```
<run>/weights/<policy>/v00000012/anchor.safetensors    full checkpoint (every K versions)
<run>/weights/<policy>/v00000013/delta.zst             sparse delta v12 -> v13 (zstd frame)
<run>/weights/<policy>/v00000013/manifest.json         written last, conditional put
<run>/trainer/<policy>/<name>                          resumable trainer state + consumed offsets
<run>/dataflow/<name>                                  plug-in state + offsets
<run>/claims/<digest>                                  large record payloads (claim check)
<run>/archive/<name>                                   e.g. archive/trajectories/part-00001.parquet
<run>/archive/kind=<kind>/policy=<policy>/part-<topic>-<partition>-<first offset>.parquet
                                                       the archiver's Parquet parts (hive style)
```

Versions are zero-padded to 8 digits so that a lexicographic S3 listing is in version order; a
version therefore must lie in ``[0, 99_999_999]``.
"""

from __future__ import annotations

import re

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
"""A run or policy name (also a Kafka topic component): letters, digits, ``.``, ``_``, ``-``."""
_VERSION_RE = re.compile(r"/weights/[^/]+/v(\d{8})/")
MAX_VERSION = 99_999_999
ANCHOR_FILE = "anchor.safetensors"
DELTA_FILE = "delta.zst"
MANIFEST_FILE = "manifest.json"
TRAINER_POINTER_FILE = "latest.json"
"""A trainer checkpoint's pointer, under ``<run>/trainer/<policy>/`` (it names the step's parts)."""
STEP_POINTER = "pointer.json"
"""The copy of a checkpoint's pointer in its step folder, ``<run>/trainer/<policy>/step-NNNNNNNN/``."""


def _check_name(kind: str, value: str) -> str:
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise ValueError(
            f"invalid {kind} name {value!r}: use 1-200 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


def _check_relpath(kind: str, value: str) -> str:
    """A relative key suffix such as ``step-12/optimizer.pt``: no empty, ``.`` or ``..`` segments."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"invalid {kind} {value!r}: must be a non-empty relative path")
    for seg in value.split("/"):
        if seg in {"", ".", ".."} or not re.match(r"^[A-Za-z0-9._=+-]+$", seg):
            raise ValueError(
                f"invalid {kind} {value!r}: segments must be non-empty, not '.'/'..', and use only "
                "letters, digits, '.', '_', '-', '=', '+'"
            )
    return value


def _check_version(version: int) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
        raise ValueError(f"invalid weight version {version!r}: must be an int in [0, {MAX_VERSION}]")
    return version


def parse_version(key: str) -> int:
    """The weight version in a key such as ``run/weights/pi/v00000013/delta.zst`` (-> 13)."""
    m = _VERSION_RE.search(key if key.startswith("/") else "/" + key)
    if not m:
        raise ValueError(f"no weight version (…/weights/<policy>/vNNNNNNNN/…) in key {key!r}")
    return int(m.group(1))


class RunLayout:
    """Typed key builder for one run's objects."""

    def __init__(self, run: str) -> None:
        self.run = _check_name("run", run)

    def __repr__(self) -> str:
        return f"RunLayout({self.run!r})"

    # -- weights ---------------------------------------------------------------------------------
    def weights_prefix(self, policy: str) -> str:
        """``<run>/weights/<policy>/`` — list it to find published versions."""
        return f"{self.run}/weights/{_check_name('policy', policy)}/"

    def version_prefix(self, policy: str, version: int) -> str:
        """``<run>/weights/<policy>/v00000012/``."""
        return f"{self.weights_prefix(policy)}v{_check_version(version):08d}/"

    def anchor_key(self, policy: str, version: int) -> str:
        return self.version_prefix(policy, version) + ANCHOR_FILE

    def delta_key(self, policy: str, version: int) -> str:
        """The delta that turns ``version - 1`` into ``version``."""
        return self.version_prefix(policy, version) + DELTA_FILE

    def manifest_key(self, policy: str, version: int) -> str:
        return self.version_prefix(policy, version) + MANIFEST_FILE

    def part_key(self, policy: str, version: int, kind: str, part: int, parts: int) -> str:
        """Part ``part`` of ``parts`` of a version's ``anchor`` or ``delta`` (one part: the keys above),
        e.g. ``v00000013/delta.part-1-of-2.zst``."""
        if parts == 1:
            return self.anchor_key(policy, version) if kind == "anchor" else self.delta_key(policy, version)
        stem, ext = (ANCHOR_FILE if kind == "anchor" else DELTA_FILE).split(".", 1)
        return f"{self.version_prefix(policy, version)}{stem}.part-{part}-of-{parts}.{ext}"

    def part_record_key(self, policy: str, version: int, part: int, parts: int) -> str:
        """What a rank uploaded for its part of a version (``part-1-of-2.json``), read by the rank that
        writes the manifest once every part's record is there."""
        return f"{self.version_prefix(policy, version)}part-{part}-of-{parts}.json"

    # -- other state -----------------------------------------------------------------------------
    def trainer_prefix(self, policy: str) -> str:
        return f"{self.run}/trainer/{_check_name('policy', policy)}/"

    def trainer_key(self, policy: str, name: str) -> str:
        return self.trainer_prefix(policy) + _check_relpath("trainer object name", name)

    def dataflow_key(self, name: str) -> str:
        return f"{self.run}/dataflow/{_check_relpath('dataflow object name', name)}"

    def claims_prefix(self) -> str:
        return f"{self.run}/claims/"

    def claim_key(self, digest: str) -> str:
        """``<run>/claims/<digest>``; ``digest`` is one path segment (e.g. a sha256 hex)."""
        return self.claims_prefix() + _check_name("claim digest", digest)

    def archive_prefix(self, kind: str | None = None) -> str:
        """``<run>/archive/`` or, with ``kind``, ``<run>/archive/kind=<kind>/``."""
        base = f"{self.run}/archive/"
        return base if kind is None else f"{base}kind={_check_name('archive kind', kind)}/"

    def archive_part_key(self, kind: str, policy: str | None, topic: str, partition: int, first_offset: int) -> str:
        """``<run>/archive/kind=<kind>[/policy=<policy>]/part-<topic>-<partition>-<first offset>.parquet``:
        the name depends only on where the part starts in the log, so rewriting a part after a crash
        replaces it (offset zero-padded to 20 digits: a listing is in log order)."""
        if isinstance(partition, bool) or not isinstance(partition, int) or partition < 0:
            raise ValueError(f"invalid partition {partition!r}")
        if isinstance(first_offset, bool) or not isinstance(first_offset, int) or first_offset < 0:
            raise ValueError(f"invalid offset {first_offset!r}")
        policy_dir = "" if policy is None else f"policy={_check_name('policy', policy)}/"
        return (f"{self.archive_prefix(kind)}{policy_dir}"
                f"part-{_check_name('topic', topic)}-{partition}-{first_offset:020d}.parquet")
