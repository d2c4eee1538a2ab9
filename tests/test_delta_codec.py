"""Property tests of the delta codec: bit-exact round trips, chains, and refusals that leave the
base untouched."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from astraflow.delta import (
    BaseMismatchError,
    BaseVersionError,
    DeltaCorruptError,
    DeltaError,
    DeltaFormatError,
    apply,
    apply_inplace,
    codec,
    device_crc,
    encode,
    read_header,
)
from astraflow.delta.bits import checksum, host_bits, tensor_checksum
from astraflow.delta.format import pack, parse

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
INT_OF = {2: torch.int16, 4: torch.int32}
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(INT_OF[t.element_size()]).reshape(-1)


def assert_same_bits(got: dict, want: dict) -> None:
    assert list(got) == list(want) or set(got) == set(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(bits(g), bits(w)), name


def snapshot(sd: dict) -> dict:
    return {k: v.clone() for k, v in sd.items()}


def random_bits(rng: np.random.Generator, n: int, dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    if n == 0:
        return torch.empty(0, dtype=dtype)
    raw = rng.integers(0, 256, size=n * size, dtype=np.uint8)
    t = torch.from_numpy(raw).view(dtype)
    if n and size == 2:  # make sure -0.0, NaN payloads and infinities occur
        special = torch.tensor([0x8000, 0x7FC1, 0xFFFF, 0x7F80, 0x0001], dtype=torch.int32).to(torch.int16)
        k = min(n, len(special))
        t.view(torch.int16)[:k] = special[:k]
    return t


@st.composite
def tensor_change(draw, dtype=None):
    """(old, new) with the same dtype/shape: random bits, a fraction 1-sparsity of them changed,
    either to random bits or by +-1 ulp (what an optimizer step does)."""
    dtype = dtype or draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 40), min_size=0, max_size=3))
    sparsity = draw(st.floats(0.0, 1.0))
    ulp_steps = draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = math.prod(shape)
    old = random_bits(rng, n, dtype)
    new = old.clone()
    change = torch.from_numpy(rng.random(n) >= sparsity)
    nb = bits(new)
    if ulp_steps:
        step = torch.from_numpy(rng.choice([-1, 1], size=n)).to(nb.dtype)
        nb[change] = nb[change] + step[change]
    else:
        nb[change] = bits(random_bits(rng, n, dtype))[change]
    return old.reshape(shape), new.reshape(shape)


@st.composite
def state_change(draw):
    k = draw(st.integers(1, 4))
    pairs = [draw(tensor_change()) for _ in range(k)]
    old = {f"layer{i}.w": a for i, (a, _) in enumerate(pairs)}
    new = {f"layer{i}.w": b for i, (_, b) in enumerate(pairs)}
    return old, new


# -- round trips -------------------------------------------------------------------------------
@FAST
@given(state_change())
def test_apply_encode_is_bit_exact(pair):
    old, new = pair
    before = snapshot(old)
    delta = encode(old, new, base_version=3, target_version=4)
    assert_same_bits(apply(old, delta, base_version=3), new)
    assert_same_bits(old, before)  # apply never writes the base
    assert_same_bits(apply_inplace(old, delta, base_version=3), new)


@FAST
@given(state_change(), st.sampled_from(["added", "removed", "dtype", "shape"]))
def test_structural_changes_are_stored(pair, kind):
    old, new = pair
    new = dict(new)
    if kind == "added":
        new["extra.bias"] = torch.randn(7).to(torch.float16)
    elif kind == "removed":
        old = {**old, "gone": torch.zeros(3)}
    elif kind == "dtype":
        new["layer0.w"] = new["layer0.w"].float()
    else:
        new["layer0.w"] = torch.ones(2, 3, dtype=new["layer0.w"].dtype)
    delta = encode(old, new, base_version=0, target_version=1)
    assert_same_bits(apply(old, delta), new)
    assert_same_bits(apply_inplace(snapshot(old), delta), new)


def test_header_counts_changes():
    old = {"w": torch.zeros(1000, dtype=torch.bfloat16), "same": torch.ones(10)}
    new = {"w": old["w"].clone(), "same": old["same"].clone()}
    new["w"][[3, 500, 999]] = 1.0
    header = read_header(encode(old, new, base_version=7, target_version=8))
    assert (header.base_version, header.target_version) == (7, 8)
    ops = {t.name: (t.op, t.nnz) for t in header.tensors}
    assert ops == {"w": ("sparse", 3), "same": ("same", 0)}
    assert header.sparsity == pytest.approx(1 - 3 / 1010)


def test_dense_change_uses_no_positions():
    old = {"w": torch.randn(4096).to(torch.bfloat16)}
    new = {"w": (old["w"].float() * 1.5).to(torch.bfloat16)}
    delta = encode(old, new, base_version=0, target_version=1)
    assert read_header(delta).tensors[0].op == "dense"
    assert_same_bits(apply(old, delta), new)


def test_sparse_bf16_is_far_smaller_than_index_plus_value():
    rng = np.random.default_rng(0)
    old = {"w": torch.from_numpy(rng.normal(0, 0.02, 200_000).astype(np.float32)).to(torch.bfloat16)}
    nb = bits(old["w"]).clone()
    pos = rng.choice(nb.numel(), 3000, replace=False)
    nb[pos] += torch.from_numpy(rng.choice([-1, 1], 3000)).to(torch.int16)
    new = {"w": nb.view(torch.bfloat16)}
    delta = encode(old, new, base_version=0, target_version=1)
    assert len(delta) < 0.5 * 3000 * 6  # AstraFlow's u32 index + bf16 value would be 18 kB
    assert_same_bits(apply(old, delta), new)


def test_torch_path_matches_numpy_path(monkeypatch):
    """The CUDA code path (torch ops on the tensor's device), exercised here on CPU tensors."""
    rng = np.random.default_rng(1)
    old = {"a": random_bits(rng, 5000, torch.bfloat16), "b": random_bits(rng, 300, torch.float32)}
    new = snapshot(old)
    bits(new["a"])[::37] ^= 3
    bits(new["b"])[:] ^= 1  # dense
    old["c"] = random_bits(rng, 200_000, torch.int16)
    new["c"] = old["c"].clone()
    bits(new["c"])[[0, 70_000, 199_999]] ^= 9  # gaps past 65535: 4-byte gap planes
    host = encode(old, new, base_version=0, target_version=1)
    assert {e.name: e.gap_width for e in read_header(host).tensors}["c"] == 4
    monkeypatch.setattr(codec, "_on_host", lambda t: False)
    device = encode(old, new, base_version=0, target_version=1)
    assert device == host
    assert_same_bits(apply(old, device), new)
    base = snapshot(old)
    base["a"] = base["a"].reshape(50, 100).t()  # non-contiguous base tensors are written through
    want = snapshot(new)
    want["a"] = want["a"].reshape(50, 100).t()
    delta = encode(snapshot(base), want, base_version=0, target_version=1)
    assert_same_bits(apply_inplace(base, delta), want)


@FAST
@given(state_change(), st.sampled_from([2, 64, 1000]))
def test_host_diff_in_chunks_matches_device_path(pair, chunk_bytes):
    """The host diff reads each tensor in chunks (XOR, positions, values, CRCs of a chunk at once): any chunk
    size, a change turning dense mid-tensor, and CRCs given or not give the device path's bytes and CRCs."""
    old, new = pair
    want = encode(old, new, base_version=0, target_version=1)  # default chunks (tensors this small: one)
    saved_host, saved_chunk = codec._on_host, codec.HOST_CHUNK_BYTES
    try:
        codec._on_host = lambda t: False
        device = encode(old, new, base_version=0, target_version=1)
        codec._on_host, codec.HOST_CHUNK_BYTES = saved_host, chunk_bytes
        crcs: dict[str, int] = {}
        chunked = encode(old, new, base_version=0, target_version=1, crcs_out=crcs)
        given_crcs = encode(old, new, base_version=0, target_version=1, threads=1,
                            crcs_old={k: tensor_checksum(v) for k, v in old.items()},
                            crcs_new={k: tensor_checksum(v) for k, v in new.items()})
    finally:
        codec._on_host, codec.HOST_CHUNK_BYTES = saved_host, saved_chunk
    assert chunked == want == device == given_crcs
    assert crcs == {k: tensor_checksum(v) for k, v in new.items()}


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 3 * device_crc.BLOCK + 7), st.sampled_from(DTYPES), st.integers(0, 2**32 - 1))
def test_device_crc_equals_crc32c(n, dtype, seed):
    """The block-table CRC-32C (the CUDA path, run here with torch on the CPU) equals crc32c's."""
    t = random_bits(np.random.default_rng(seed), n, dtype)
    assert device_crc.device_crc32c(t) == checksum(host_bits(t))


def test_device_crc_folds_many_blocks(monkeypatch):
    """Several gather chunks and an odd number of blocks to fold, a strided view, a 2-D tensor."""
    monkeypatch.setattr(device_crc, "CHUNK_BLOCKS", 3)
    t = random_bits(np.random.default_rng(5), 11 * device_crc.BLOCK + 3, torch.uint8)
    assert device_crc.device_crc32c(t) == checksum(host_bits(t))
    view = random_bits(np.random.default_rng(6), 40_000, torch.bfloat16).reshape(200, 200).t()
    assert device_crc.device_crc32c(view) == checksum(host_bits(view.contiguous()))


# -- chains ------------------------------------------------------------------------------------
@settings(max_examples=5, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(DTYPES))
def test_chain_of_20_deltas_equals_final_state(seed, dtype):
    rng = np.random.default_rng(seed)
    states = [{"w": random_bits(rng, 3000, dtype).reshape(30, 100), "b": random_bits(rng, 17, dtype)}]
    for _ in range(20):
        nxt = snapshot(states[-1])
        for t in nxt.values():
            b = bits(t)
            b[torch.from_numpy(rng.random(b.numel()) < rng.uniform(0, 0.1))] += 1
        states.append(nxt)
    deltas = [encode(states[i], states[i + 1], base_version=i, target_version=i + 1) for i in range(20)]
    held = snapshot(states[0])
    copy = snapshot(states[0])
    for v, d in enumerate(deltas):
        apply_inplace(held, d, base_version=v)
        copy = apply(copy, d, base_version=v)
    assert_same_bits(held, states[20])
    assert_same_bits(copy, states[20])


# -- refusals ----------------------------------------------------------------------------------
def _fixture():
    rng = np.random.default_rng(2)
    old = {"emb": random_bits(rng, 4000, torch.bfloat16).reshape(40, 100), "norm": random_bits(rng, 64, torch.float32)}
    new = snapshot(old)
    bits(new["emb"])[::50] += 1
    bits(new["norm"])[3] ^= 0x10
    return old, new, encode(old, new, base_version=5, target_version=6)


def _assert_refused(base: dict, delta, err: type[DeltaError], **kw) -> None:
    before = snapshot(base)
    with pytest.raises(err):
        apply(base, delta, **kw)
    assert_same_bits(base, before)
    keys = list(base)
    with pytest.raises(err):
        apply_inplace(base, delta, **kw)
    assert list(base) == keys
    assert_same_bits(base, before)


def test_wrong_base_version_refused():
    old, _, delta = _fixture()
    _assert_refused(old, delta, BaseVersionError, base_version=4)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_truncated_delta_refused(data):
    old, _, delta = _fixture()
    cut = data.draw(st.integers(0, len(delta) - 1))
    _assert_refused(old, delta[:cut], DeltaCorruptError)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_flipped_byte_refused(data):
    old, _, delta = _fixture()
    pos = data.draw(st.integers(0, len(delta) - 1))
    flip = data.draw(st.integers(1, 255))
    bad = bytearray(delta)
    bad[pos] ^= flip
    _assert_refused(old, bytes(bad), DeltaError)


def test_not_a_delta_refused():
    old, _, delta = _fixture()
    _assert_refused(old, b"PK\x03\x04" + delta[4:], DeltaFormatError)


@pytest.mark.parametrize("kind", ["renamed", "missing", "extra", "shape", "dtype", "content"])
def test_mismatched_base_refused(kind):
    old, _, delta = _fixture()
    base = snapshot(old)
    if kind == "renamed":
        base["embedding"] = base.pop("emb")
    elif kind == "missing":
        del base["norm"]
    elif kind == "extra":
        base["head"] = torch.zeros(2)
    elif kind == "shape":
        base["emb"] = base["emb"].reshape(100, 40)
    elif kind == "dtype":
        base["emb"] = base["emb"].view(torch.float16)
    else:
        bits(base["norm"])[0] ^= 1
    _assert_refused(base, delta, BaseMismatchError)


def test_target_mismatch_is_undone_in_place():
    """Should a written tensor miss its target checksum (say an encoder bug), every tensor written
    so far is restored before the refusal."""
    old, _, delta = _fixture()
    header, payload = parse(delta)
    header.tensors[-1].crc_target ^= 1  # the last tensor fails after the first was written
    bad = pack(header, [bytes(payload)])
    _assert_refused(old, bad, DeltaCorruptError)


def test_refusals_checked_before_any_write():
    old, _new, delta = _fixture()
    bad = bytearray(delta)
    bad[-1] ^= 0xFF  # corrupts the last tensor's stream; the first must not be written either
    base = snapshot(old)
    with pytest.raises(DeltaCorruptError):
        apply_inplace(base, bytes(bad))
    assert_same_bits(base, old)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_round_trip_on_device():
    rng = np.random.default_rng(3)
    old = {"a": random_bits(rng, 100_000, torch.bfloat16), "b": random_bits(rng, 1000, torch.float32)}
    new = snapshot(old)
    bits(new["a"])[::41] += 1
    bits(new["b"])[:] ^= 1
    host = encode(old, new, base_version=0, target_version=1)
    gpu_old = {k: v.cuda() for k, v in old.items()}
    gpu_new = {k: v.cuda() for k, v in new.items()}
    assert encode(gpu_old, gpu_new, base_version=0, target_version=1) == host
    assert all(tensor_checksum(t) == checksum(host_bits(t.cpu())) for t in gpu_new.values())  # on the GPU
    crcs = {k: tensor_checksum(v) for k, v in new.items()}
    assert encode(gpu_old, gpu_new, base_version=0, target_version=1, crcs_new=crcs) == host
    out = apply(gpu_old, host)
    assert all(t.is_cuda for t in out.values())
    assert_same_bits({k: v.cpu() for k, v in out.items()}, new)
    apply_inplace(gpu_old, host)
    assert_same_bits({k: v.cpu() for k, v in gpu_old.items()}, new)


@pytest.mark.parametrize("versions", [1, 3])
def test_a_version_in_row_parts_patches_to_the_bits_of_its_target(versions):
    """A node's patch from deltas published in parts (rows split as ranks split them): one version's
    parts fold by concatenation, a chain of them (overlapping positions) by sort and XOR; both equal
    the targets bit for bit."""
    from astraflow.delta.parts import chunk_rows, row_views
    from astraflow.delta.patch import prepare_patch

    gen = torch.Generator().manual_seed(5)
    states = [{"a": torch.randn(41, 8, generator=gen).to(torch.bfloat16), "b": torch.randn(9, generator=gen)}]
    for _ in range(versions):
        nxt = {}
        for name, t in states[-1].items():
            flat = bits(t.clone())
            flat[torch.randperm(flat.numel(), generator=gen)[: flat.numel() // 10]] += 1
            nxt[name] = flat.view(t.dtype).reshape(t.shape)
        states.append(nxt)
    deltas = []
    for v in range(1, versions + 1):
        parts = []
        for rank in range(3):
            rows = {name: chunk_rows(t.shape[0], rank, 3) for name, t in states[0].items()}
            old, new = row_views(dict(states[v - 1]), rows), row_views(dict(states[v]), rows)
            parts.append((rows, encode(old, new, base_version=v - 1, target_version=v)))
        deltas.append((v, parts, {n: tensor_checksum(t) for n, t in states[v].items()}))
    live = {k: t.clone() for k, t in states[0].items()}
    patch = prepare_patch(live, deltas, base_version=0)
    patch.write(live)
    assert patch.version == versions and patch.verify(live) == []
    assert_same_bits(live, states[-1])
