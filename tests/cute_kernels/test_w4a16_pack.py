"""The w4a16 kernel's weight packing (cute_kernels/w4a16_pack.py) on the CPU: every code and scale lands where
the kernel's decode reads it, for both tile kinds and both gate layouts, with N and K off the tile sizes.

Two independent statements of the layout: the inverse (unpack) gives back every code and scale bit for bit, and
a bit-level model of the kernel's decode (five shifts, masks, a bf16 multiply by 2^(s - 1), sign xors: the
instructions of w4a16_grouped.decode_word) turns each sampled word into the weights a register-A WGMMA fragment
must hold at that thread (rows g and g + 8, K columns 2t, 2t + 1, 2t + 8, 2t + 9 of each k-block, PTX ISA's
wgmma A-fragment layout), compared with the e2m1 table times 2^(s - 127)."""
from __future__ import annotations

import random

import pytest
import torch

from cute_kernels import w4a16_pack as wp
from moe_ops.quant.formats import E2M1_VALUES as E2M1

# (kind, gate layout, N, K): N and K off the tile sizes, so the padding rows and K are packed too.
CASES = [
    ("rows", None, 200, 320),
    ("rows", None, 128, 128),
    ("gate_up", "concat", 2 * 96, 256),
    ("gate_up", "interleaved", 2 * 72, 96),
    ("gate_up", "interleaved", 2 * 64, 384),
]


def _draw(e, n, k):
    """Fresh random codes (every nibble value) and scales in 1..128, the one-multiply range."""
    return torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8), torch.randint(1, 129, (e, n, k // 32), dtype=torch.uint8)


def _bf16(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).item()


def decode_model(q: int, s: int) -> list[tuple[float, float]]:
    """The kernel's decode of word q with e8m0 scale s <= 128, bit for bit: four (low, high) bf16 pairs."""

    def shift(x, by):
        return (x << by if by >= 0 else x >> -by) & 0xFFFFFFFF

    mult = _bf16(0x3F00 + (s << 7))  # scale_mult: 2^(s - 1)
    out = []
    for i in range(4):
        mag = shift(q, wp.MAG_SHIFT[i]) & wp.MAG_MASK
        sign = shift(q, wp.SIGN_SHIFT[i]) & wp.SIGN_MASK
        pair = []
        for half in range(2):
            v = _bf16((mag >> (16 * half)) & 0xFFFF) * mult  # exact: a power-of-two multiple of a subnormal
            pair.append(-v if (sign >> (16 * half)) & 0x8000 else v)
        out.append(tuple(pair))
    return out


def test_decode_model_gives_every_code_at_every_place():
    """Each of a word's 8 places, holding each of the 16 codes at its SOURCE_BITS, decodes to that code's value
    times 2^(s - 127) there and to +-0 at the other 7 places: the bit placement and the 2^126 lift agree."""
    for (i, j), (sign, e1, e0, m) in wp.SOURCE_BITS.items():
        for c in range(16):
            q = ((c >> 3) & 1) << sign | ((c >> 2) & 1) << e1 | ((c >> 1) & 1) << e0 | (c & 1) << m
            for s in (1, 2, 64, 127, 128):
                got = decode_model(q, s)
                for ii in range(4):
                    for jj in range(2):
                        want = E2M1[c] * 2.0 ** (s - 127) if (ii, jj) == (i, j) else 0.0
                        assert got[ii][jj] == want, (i, j, c, s, ii, jj, got[ii][jj])


@pytest.mark.parametrize("kind,layout,n,k", CASES)
def test_unpack_inverts_pack(kind, layout, n, k):
    codes, scales = _draw(3, n, k)
    packed = wp.pack_mxfp4_experts(codes, scales, kind=kind, gate_layout=layout)
    tiles = -(-n // 128) if kind == "rows" else -(-(n // 2) // 64)
    assert packed.shape == (3, tiles, -(-k // 128), wp.WORDS) and packed.dtype == torch.int32
    got_codes, got_scales = wp.unpack_mxfp4_experts(packed, kind=kind, gate_layout=layout, n=n, k=k)
    assert torch.equal(got_codes, codes) and torch.equal(got_scales, scales)


@pytest.mark.parametrize("kind,layout,n,k", CASES)
def test_each_thread_word_decodes_to_its_fragment(kind, layout, n, k):
    """Sampled words decode (decode_model) to the weights of the fragment places of their thread."""
    e = 2
    codes, scales = _draw(e, n, k)
    packed = wp.pack_mxfp4_experts(codes, scales, kind=kind, gate_layout=layout)
    nib = torch.stack((codes & 0xF, codes >> 4), -1).flatten(-2)
    rows = wp.row_map(kind, layout, n)
    rng = random.Random(torch.randint(0, 2**31, ()).item())
    for _ in range(300):
        x, t, kt = rng.randrange(e), rng.randrange(rows.shape[0]), rng.randrange(packed.shape[2])
        wg, warp, h, lane, g = rng.randrange(2), rng.randrange(4), rng.randrange(2), rng.randrange(32), rng.randrange(wp.GROUPS)
        q = int(packed[x, t, kt, (((wg * 4 + warp) * 2 + h) * 32 + lane) * wp.GROUPS + g]) & 0xFFFFFFFF
        tile_row = 64 * wg + 16 * warp + lane // 4 + 8 * h
        sword = int(packed[x, t, kt, wp.CODE_WORDS + ((wg * 4 + warp) * 2 + h) * 8 + lane // 4]) & 0xFFFFFFFF
        s = (sword >> (8 * g)) & 0xFF
        row = int(rows[t, tile_row])
        for i, pair in enumerate(decode_model(q, s)):
            for j in range(2):
                col = kt * wp.KT + 32 * g + 16 * (i // 2) + 8 * (i % 2) + 2 * (lane % 4) + j  # k-block 2g + i // 2
                # padding rows and K: zero codes (scale byte 0), which decode to 0
                want = 0.0 if row < 0 or col >= k else E2M1[int(nib[x, row, col])] * 2.0 ** (int(scales[x, row, col // 32]) - 127)
                got = pair[j]
                assert got == want, (kind, layout, x, t, kt, row, col, got, want)


def test_row_map_covers_every_weight_row_once():
    for kind, layout, n, _ in CASES:
        rows = wp.row_map(kind, layout, n)
        assert sorted(rows[rows >= 0].tolist()) == list(range(n)), (kind, layout)
    # gate_up: tile row c (< 64) and c + 64 are one output column's gate and up rows
    inter = 72
    for layout, gate_up in (("concat", lambda c: (c, inter + c)), ("interleaved", lambda c: (2 * c, 2 * c + 1))):
        rows = wp.row_map("gate_up", layout, 2 * inter)
        for c in range(inter):
            assert (int(rows[c // 64, c % 64]), int(rows[c // 64, 64 + c % 64])) == gate_up(c)


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(codes=torch.zeros(2, 8, 16, dtype=torch.int8)), TypeError, "codes: want uint8"),
        (dict(scales=torch.zeros(2, 8, 2, dtype=torch.uint8)), TypeError, r"scales: want uint8 e8m0 \[E, N, K/32\] = \(2, 8, 1\)"),
        (dict(kind="k_split"), ValueError, "kind='k_split'; allowed"),
        (dict(kind="gate_up", gate_layout="none"), ValueError, "gate_layout='none' with kind 'gate_up'"),
        (dict(gate_layout="concat"), ValueError, "gate_layout='concat' with kind 'rows'"),
        (dict(codes=torch.zeros(2, 8, 8, dtype=torch.uint8), scales=torch.zeros(2, 8, 1, dtype=torch.uint8)), ValueError, "K = 16"),
    ],
)
def test_bad_input_is_refused(change, error, match):
    args = dict(codes=torch.zeros(2, 8, 16, dtype=torch.uint8), scales=torch.zeros(2, 8, 1, dtype=torch.uint8), kind="rows", gate_layout=None)
    args.update(change)
    with pytest.raises(error, match=match):
        wp.pack_mxfp4_experts(args.pop("codes"), args.pop("scales"), **args)


@pytest.mark.parametrize("kind, layout", [("rows", None), ("gate_up", "concat"), ("gate_up", "interleaved")])
def test_row_map_is_built_on_its_device(kind, layout):
    """The reference's unpacking (tiled mxfp4 on CUDA) builds its row map on the weights' device: a copy
    from the CPU would fail inside a CUDA graph capture. Meta tensors show where it was built."""
    rows = wp.row_map(kind, layout, 320, device="meta")
    assert rows.device.type == "meta" and rows.shape == wp.row_map(kind, layout, 320).shape
