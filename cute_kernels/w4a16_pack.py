"""mxfp4 expert weights re-laid for the w4a16 grouped GEMM (w4a16_grouped.py), once, at weight preparation.

The kernel reads one chunk per (expert, tile, k-tile of KT = 128) by one bulk copy, and each consumer thread
turns its own 32-bit words straight into its register-A WGMMA fragments, so the layout follows the fragment:

- code words, ordered (warpgroup, warp, row half h, lane, group G of 32 K): the word of lane
  (g = lane // 4, t = lane % 4) at tile row 16 warp + g + 8 h (+ 64 per warpgroup) holds that thread's 8 codes of
  group G: K columns 2t, 2t + 1, 2t + 8, 2t + 9 of k-blocks 2G and 2G + 1 (its four bf16x2 fragment registers);
- then the scale words, one per tile row, ordered (16-row group, row half h, row lane // 4): byte b is the e8m0
  scale of the row's group b in the k-tile (the four lanes of a row read the same word).

Within a word the bits of each code sit where five shifts of the word (SHIFTS) put them at bf16's sign, lowest
two exponent bits and highest mantissa bit: the e2m1 code becomes a bf16 subnormal, which one bf16x2 multiply
by 2^126 x 2^(s - 127) decodes exactly (w4a16_grouped.decode_word). An exhaustive search over packings of this
decode (branch wip/w4a16, w4_shift_search.py) finds no placement with fewer than five shifts.

Tile kinds (which weight row each of a tile's 128 rows reads, row_map):
- "rows": 128 consecutive weight rows, 64 per consumer warpgroup: GEMM2, or GEMM1 without an activation;
- "gate_up": 64 output columns: warpgroup 0 multiplies their gate rows, warpgroup 1 their up rows, for either
  gate layout ([gate; up] "concat" or "interleaved" pairs), so the epilogue pairs them within a thread.
Rows past the weights and K past K_pad (K rounded up to KT) are zero codes with scale byte 0: they decode to 0.
"""
from __future__ import annotations

import torch

from .tiles import cdiv

KT = 128  # K per k-tile
TILE_ROWS = 128  # weight rows per tile (two consumer warpgroups of 64)
GROUP = 32  # mxfp4's K per scale
GROUPS = KT // GROUP  # groups per k-tile
CODE_WORDS = TILE_ROWS * KT // 8  # 8 codes per word
SCALE_WORDS = TILE_ROWS * GROUPS // 4  # a row's 4 scales of the k-tile in one word
WORDS = CODE_WORDS + SCALE_WORDS  # per chunk: 2176 words, 8704 bytes
KINDS = ("rows", "gate_up")
GATE_LAYOUTS = ("concat", "interleaved")

# Output i of a word (its fragment register: k-block 2G + i // 2, K half i % 2) takes its magnitude bits from
# the word shifted by MAG_SHIFT[i] and its sign bits from the word shifted by SIGN_SHIFT[i] (< 0: right).
MAG_SHIFT = (0, 3, 6, -3)
SIGN_SHIFT = (0, 1, 2, 3)
# Where the shifted word's bits must land: bf16 (E1, E0, M) of the low and high half, and the two sign bits.
MAG_MASK = 0x01C001C0
SIGN_MASK = 0x80008000
_MAG_POS = ((8, 7, 6), (24, 23, 22))
_SIGN_POS = (15, 31)


def _source_bits() -> dict[tuple[int, int], tuple[int, int, int, int]]:
    """(output i, half j) -> the word's bit positions of the code's (sign, E1, E0, M); every bit used once."""
    table = {}
    for i in range(4):
        for j in range(2):
            sign = _SIGN_POS[j] - SIGN_SHIFT[i]
            table[i, j] = (sign, *(p - MAG_SHIFT[i] for p in _MAG_POS[j]))
    assert sorted(b for v in table.values() for b in v) == list(range(32))
    return table


SOURCE_BITS = _source_bits()


def output_columns(kind: str, n: int) -> int:
    """The GEMM's output columns: N for "rows", N / 2 for "gate_up" (the activation's output)."""
    return n if kind == "rows" else n // 2


def row_map(kind: str, gate_layout: str | None, n: int, device=None) -> torch.Tensor:
    """int64 [tiles, 128] on `device` (the CPU by default): the weight row (of N) each tile row reads; -1
    past the weights. Built there, not copied: a host-to-device copy would fail inside a CUDA graph capture."""
    if kind == "rows":
        t = cdiv(n, TILE_ROWS)
        r = torch.arange(t * TILE_ROWS, device=device).reshape(t, TILE_ROWS)
        return torch.where(r < n, r, -1)
    inter = n // 2
    c = torch.arange(cdiv(inter, 64) * 64, device=device).reshape(-1, 64)
    gate, up = (c, inter + c) if gate_layout == "concat" else (2 * c, 2 * c + 1)
    return torch.where(torch.cat((c, c), 1) < inter, torch.cat((gate, up), 1), -1)


def check_experts(codes, scales, kind, gate_layout) -> tuple[int, int, int]:
    """(E, N, K) of mxfp4 experts to pack as `kind`; TypeError/ValueError naming what cannot be packed."""
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.dim() != 3:
        raise TypeError(f"codes: want uint8 [E, N, K/2] (two e2m1 per byte), got {getattr(codes, 'dtype', type(codes))} "
                        f"{tuple(getattr(codes, 'shape', ()))}")  # fmt: skip
    e, n, k = codes.shape[0], codes.shape[1], 2 * codes.shape[2]
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8 or tuple(scales.shape) != (e, n, cdiv(k, GROUP)):
        raise TypeError(f"scales: want uint8 e8m0 [E, N, K/32] = {(e, n, cdiv(k, GROUP))}, got "
                        f"{getattr(scales, 'dtype', type(scales))} {tuple(getattr(scales, 'shape', ()))}")  # fmt: skip
    if scales.device != codes.device:
        raise ValueError(f"scales on {scales.device}, codes on {codes.device}: want one device")
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; allowed: {KINDS}")
    if kind == "gate_up" and gate_layout not in GATE_LAYOUTS:
        raise ValueError(f"gate_layout={gate_layout!r} with kind 'gate_up'; allowed: {GATE_LAYOUTS}")
    if kind == "rows" and gate_layout is not None:
        raise ValueError(f"gate_layout={gate_layout!r} with kind 'rows', whose tiles hold plain rows; allowed: None")
    if kind == "gate_up" and n % 2:
        raise ValueError(f"codes: N = {n} with kind 'gate_up'; want N = 2 I, even")
    if k % GROUP:
        raise ValueError(f"codes: K = {k}; mxfp4 wants a multiple of {GROUP}")
    return e, n, k


def _rows_padded(kind: str, gate_layout: str | None, n: int, device) -> torch.Tensor:
    """row_map with the padding rows (-1) pointing at row n, the zero row the packer appends."""
    rmap = row_map(kind, gate_layout, n, device)
    return torch.where(rmap < 0, n, rmap)


def _word_index(kind: str, gate_layout: str | None, n: int, k_tiles: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight row, first K) of every code word of one expert's chunks, each [tiles, k_tiles, CODE_WORDS]."""
    rmap = _rows_padded(kind, gate_layout, n, device)
    ar = lambda m: torch.arange(m, device=device)  # noqa: E731
    i_t, i_k, i_wg, i_w, i_h, i_l, i_g = torch.meshgrid(
        ar(rmap.shape[0]), ar(k_tiles), ar(2), ar(4), ar(2), ar(32), ar(GROUPS), indexing="ij"
    )  # fmt: skip
    row = rmap[i_t, 64 * i_wg + 16 * i_w + i_l // 4 + 8 * i_h]
    k0 = i_k * KT + i_g * GROUP + 2 * (i_l % 4)
    shape = (rmap.shape[0], k_tiles, CODE_WORDS)
    return row.reshape(shape), k0.reshape(shape)


def _scale_index(kind: str, gate_layout: str | None, n: int, k_tiles: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight row, scale column) of every scale byte of one expert's chunks, [tiles, k_tiles, SCALE_WORDS, 4]."""
    rmap = _rows_padded(kind, gate_layout, n, device)
    ar = lambda m: torch.arange(m, device=device)  # noqa: E731
    i_t, i_k, i_rg, i_h, i_r, i_j, i_b = torch.meshgrid(
        ar(rmap.shape[0]), ar(k_tiles), ar(TILE_ROWS // 16), ar(2), ar(8), ar(GROUPS // 4), ar(4), indexing="ij"
    )  # fmt: skip
    row = rmap[i_t, 16 * i_rg + i_r + 8 * i_h]
    col = i_k * GROUPS + 4 * i_j + i_b
    shape = (rmap.shape[0], k_tiles, SCALE_WORDS, 4)
    return row.reshape(shape), col.reshape(shape)


def pack_mxfp4_experts(codes: torch.Tensor, scales: torch.Tensor, *, kind: str, gate_layout: str | None = None) -> torch.Tensor:
    """mxfp4 experts -> the grouped kernel's chunks.

    codes uint8 [E, N, K/2] (element 2j in the low nibble of byte j), scales uint8 e8m0 [E, N, K/32]
    -> int32 [E, tiles, k_tiles, WORDS] with tiles = cdiv(N, 128) ("rows") or cdiv(N / 2, 64) ("gate_up"),
    k_tiles = cdiv(K, 128). On the codes' device, one expert at a time (the index maps are shared)."""
    e, n, k = check_experts(codes, scales, kind, gate_layout)
    device = codes.device
    k_tiles = cdiv(k, KT)
    k_pad = k_tiles * KT
    row, k0 = _word_index(kind, gate_layout, n, k_tiles, device)
    srow, scol = _scale_index(kind, gate_layout, n, k_tiles, device)
    out = torch.empty((e, row.shape[0], k_tiles, WORDS), dtype=torch.int32, device=device)
    for x in range(e):
        nib = torch.stack((codes[x] & 0xF, codes[x] >> 4), -1).flatten(-2).to(torch.int64)  # [N, K]
        nib = torch.nn.functional.pad(nib, (0, k_pad - k, 0, 1))  # K padding and the zero row n
        word = torch.zeros(row.shape, dtype=torch.int64, device=device)
        for (i, j), (sign, e1, e0, m) in SOURCE_BITS.items():
            c = nib[row, k0 + 16 * (i // 2) + 8 * (i % 2) + j]
            word |= ((c >> 3) & 1) << sign | ((c >> 2) & 1) << e1 | ((c >> 1) & 1) << e0 | (c & 1) << m
        sc = torch.nn.functional.pad(scales[x].to(torch.int64), (0, k_pad // GROUP - scales.shape[2], 0, 1))
        sword = (sc[srow, scol] << (8 * torch.arange(4, device=device))).sum(-1)
        chunk = torch.cat((word, sword), -1)
        out[x] = ((chunk + 2**31) % 2**32 - 2**31).to(torch.int32)  # the words' bits as int32
    return out


def tiles_of(kind: str, n: int) -> int:
    """Tiles per expert of an [N, K] weight packed as `kind`: cdiv(N, 128) ("rows") or cdiv(N / 2, 64) ("gate_up")."""
    return cdiv(n, TILE_ROWS) if kind == "rows" else cdiv(n // 2, TILE_ROWS // 2)


def tiled_chunks(kind: str, n: int, k: int) -> tuple[int, int]:
    """(S, B): the chunks per expert and the bytes per weight row of weights tiled at load time, uint8 [E, N, B].

    An expert's N * B bytes hold S >= tiles * k_tiles whole chunks, its own first: N stays the tensor's second
    size (every shape check and fake impl reads the weights' rows there) and the kernel finds expert e at chunk
    e * S. S is the least multiple of N / gcd(N, chunk bytes) that holds the chunks, so N * B = S * chunk bytes;
    for N a multiple of 64 the padding is under 1 / k_tiles of the chunks (gpt-oss w2: 540 for 529)."""
    need = tiles_of(kind, n) * cdiv(k, KT)
    g, r = n, 4 * WORDS
    while r:  # gcd(n, chunk bytes) by hand: shape checks call this under torch.compile, whose Dynamo has no math.gcd
        g, r = r, g % r
    step = n // g
    s = cdiv(need, step) * step
    return s, s * 4 * WORDS // n


def tile_mxfp4_experts(codes: torch.Tensor, scales: torch.Tensor, *, kind: str, gate_layout: str | None = None,
                       pack=None, step: int = 1) -> torch.Tensor:  # fmt: skip
    """mxfp4 experts -> uint8 [E, N, B] (tiled_chunks): pack_mxfp4_experts' chunks, each expert padded with zero
    chunks to N * B bytes. The kernels read it as int32 [E, S, WORDS] (tiled_words). pack(lo, hi) -> int32
    [hi - lo, tiles, k_tiles, WORDS], experts lo..hi packed as pack_mxfp4_experts packs them (its default, one
    expert's int64 temporaries at a time), is called for `step` experts at a time (a faster packer: moe_ops'
    Triton one on CUDA)."""
    e, n, k = check_experts(codes, scales, kind, gate_layout)
    s, b = tiled_chunks(kind, n, k)
    if pack is None:
        pack = lambda lo, hi: pack_mxfp4_experts(codes[lo:hi], scales[lo:hi], kind=kind, gate_layout=gate_layout)  # noqa: E731
    out = torch.zeros((e, s, WORDS), dtype=torch.int32, device=codes.device)
    for lo in range(0, e, step):
        hi = min(e, lo + step)
        packed = pack(lo, hi).flatten(1, 2)
        out[lo:hi, : packed.shape[1]] = packed
    return out.view(torch.uint8).view(e, n, b)


def tiled_words(tiled: torch.Tensor) -> torch.Tensor:
    """uint8 [E, N, B] tiled weights -> the int32 [E, S, WORDS] view the kernels read (no copy)."""
    e = tiled.shape[0]
    return tiled.view(e, -1).view(torch.int32).view(e, -1, WORDS)


def untile_mxfp4_experts(tiled: torch.Tensor, *, kind: str, gate_layout: str | None, k: int, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of tile_mxfp4_experts: uint8 [E, N, B] -> (codes uint8 [E, N, K/2], scales uint8 [E, N, K/32]).
    Plain torch, any device; check: raise ValueError if a padding code or scale is not 0 (a host sync)."""
    e, n = tiled.shape[0], tiled.shape[1]
    t = tiles_of(kind, n)
    k_tiles = cdiv(k, KT)
    words = tiled_words(tiled.contiguous())[:, : t * k_tiles].reshape(e, t, k_tiles, WORDS)
    return unpack_mxfp4_experts(words, kind=kind, gate_layout=gate_layout, n=n, k=k, check=check)


def unpack_mxfp4_experts(packed: torch.Tensor, *, kind: str, gate_layout: str | None, n: int, k: int, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of pack_mxfp4_experts: int32 [E, tiles, k_tiles, WORDS] -> (codes uint8 [E, N, K/2],
    scales uint8 [E, N, K/32]). check: raise ValueError if a padding code or scale is not 0 (a host sync)."""
    e = packed.shape[0]
    k_tiles = cdiv(k, KT)
    device = packed.device
    row, k0 = _word_index(kind, gate_layout, n, k_tiles, device)
    srow, scol = _scale_index(kind, gate_layout, n, k_tiles, device)
    words = packed.to(torch.int64) & 0xFFFFFFFF
    nib = torch.zeros((e, n + 1, k_tiles * KT), dtype=torch.int64, device=device)
    sc = torch.zeros((e, n + 1, k_tiles * GROUPS), dtype=torch.int64, device=device)
    code_words = words[..., :CODE_WORDS]
    for (i, j), (sign, e1, e0, m) in SOURCE_BITS.items():
        c = ((code_words >> sign) & 1) << 3 | ((code_words >> e1) & 1) << 2 | ((code_words >> e0) & 1) << 1 | (code_words >> m) & 1
        nib[:, row, k0 + 16 * (i // 2) + 8 * (i % 2) + j] = c
    sbytes = (words[..., CODE_WORDS:, None] >> (8 * torch.arange(4, device=device))) & 0xFF
    sc[:, srow, scol] = sbytes
    if check and bool((nib[:, n] != 0).any() or (nib[:, :, k:] != 0).any() or (sc[:, n] != 0).any() or (sc[:, :, k // GROUP :] != 0).any()):
        raise ValueError("packed: a padding code or scale is not 0")
    nib = nib[:, :n, :k]
    codes = (nib[..., 0::2] | nib[..., 1::2] << 4).to(torch.uint8)
    return codes, sc[:, :n, : k // GROUP].to(torch.uint8)
