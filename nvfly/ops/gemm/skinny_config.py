"""The skinny GEMM kernel's geometry (chunks, tiles, shared-memory stages) and its config space.

Pure Python (no tracing): the kernel, its plans and the autotuning sweeps read these.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

MAX_M = 16              # two n8 mma tiles of tokens
ROWS = 16               # output columns (W rows) per CTA: the mma's M
CHUNK_K = 32            # k per chunk: 32 lanes x 16 bytes cover 16 rows x 32 k, two k16 mma steps
VECTOR = 8              # elements per lane per row per chunk (16 bytes)
# row-major B: a CTA owns 64 consecutive columns (128-byte rows of B per k) staged in 32 x 64 chunks
COLS_ROW_B = 64
SEGMENTS = COLS_ROW_B // VECTOR          # 16-byte segments per staged k row
CHUNK_BYTES = CHUNK_K * COLS_ROW_B * 2   # one ring stage (4 KB)
# shared memory per CTA: the opt-in maximum (sm_90: 227 KB of dynamic plus static; the runtime opts in past 48 KB,
# runtime.driver.smem_opt_in)
MAX_SMEM = 227 * 1024
# row-major B with split K: the CTA's arrival count lives in dynamic shared memory right after the rings (a
# static array would sit before the 1024-byte aligned dynamic region and take 1 KB of static shared memory)
ARRIVAL_BYTES = 16
# staged (column-major) tokens: one n8 token tile of a chunk in shared memory, 32 k rows of 8 tokens (16 bytes)
TOKEN_TILE_BYTES = CHUNK_K * VECTOR * 2

# how the column-major-B kernel gets column-major tokens (SkinnyConfig.column_tokens; skinny_kernel's docstring,
# "Column-major tokens"): element loads, or per load group 16-byte copies of 8 tokens at one k into shared memory
# read back by ldmatrix.trans (by cp.async, or by vector loads into registers and st.shared), or 32-bit token
# pairs transposed in registers by movmatrix
COLUMN_TOKENS = ("loads", "cp.async", "registers", "movmatrix")
STAGED_TOKENS = ("cp.async", "registers")  # the ones that use token stages in shared memory


@dataclass(frozen=True)
class SkinnyConfig:
    """warps: per CTA, splitting its K range; unroll: 32-wide k chunks a warp loads before its mmas (1 KB of W
    each), or with row-major B the depth of each warp's cp.async ring (4 KB stages, at least 2); splits: CTAs
    per column group, each reducing one K range (fp32 workspace when > 1); token_vectors (row-major B only):
    permute k in the ldmatrix addressing so that the tokens load as one 16-byte vector per token tile and chunk,
    a chunk ahead, instead of pair by pair (where the tokens' rows allow it; untimed, hence off by default);
    column_tokens (column-major B only): how column-major tokens reach the mmas, one of COLUMN_TOKENS (where x's
    layout allows it, else "loads": ``token_path``); "loads" in an explicit config, COLUMN_B_TOKENS in the
    heuristic's (``default_config``). Every field is part of the kernel's compile key (CFG)."""
    warps: int = 8
    unroll: int = 4
    splits: int = 1
    token_vectors: bool = False
    column_tokens: str = "loads"

    def check(self, row_b: bool = False) -> Optional[str]:
        """None when the kernel (with ``row_b``, its row-major-B variant) can be built and launched with this
        config, else why not."""
        if not 1 <= self.warps <= 32:
            return f"warps={self.warps}: 1 to 32"
        if not 1 <= self.unroll <= 16:
            return f"unroll={self.unroll}: 1 to 16"
        if self.splits < 1:
            return f"splits={self.splits}: at least 1"
        if self.token_vectors and not row_b:
            return ("token_vectors: an option of the row-major-B kernel (column-major B loads its tokens as 16-byte "
                    "vectors already)")
        if self.column_tokens not in COLUMN_TOKENS:
            return f"column_tokens={self.column_tokens!r}: one of {', '.join(map(repr, COLUMN_TOKENS))}"
        if self.column_tokens != "loads" and row_b:
            return (f"column_tokens={self.column_tokens!r}: an option of the column-major-B kernel (row-major B "
                    "stages column-major tokens with its ring's cp.async copies)")
        if self.column_tokens in STAGED_TOKENS and column_b_staged_smem_bytes(self, 1) > MAX_SMEM:
            return (f"column_tokens={self.column_tokens!r}: warps={self.warps} x unroll={self.unroll} token stages "
                    f"need {column_b_staged_smem_bytes(self, 1)} bytes of shared memory per CTA; at most {MAX_SMEM}")
        if row_b:
            if self.unroll < 2:
                return f"unroll={self.unroll}: row-major B needs a ring of at least 2 stages"
            smem = row_b_smem_bytes(self)
            if smem > MAX_SMEM:
                return (f"warps={self.warps} x unroll={self.unroll} ring stages of {CHUNK_BYTES} bytes need {smem} "
                        f"bytes of shared memory per CTA; at most {MAX_SMEM}")
        return None


def staged_token_bytes(config: SkinnyConfig, m_tiles: int) -> int:
    """Shared memory of staged tokens (``stage_tokens``): ``unroll`` chunks of ``m_tiles`` token tiles per warp
    (row-major B: a token stage beside each ring stage; column-major B: one per chunk of a warp's load group)."""
    return config.warps * config.unroll * m_tiles * TOKEN_TILE_BYTES


def row_b_smem_bytes(config: SkinnyConfig, staged_token_tiles: int = 0) -> int:
    """Dynamic shared memory of the row-major-B kernel (it has no static shared memory): every warp's ring of
    ``unroll`` stages (reused for the warps' partial tiles), the token stages when ``staged_token_tiles`` token
    tiles are staged, and, with split K, the arrival count after them."""
    return (config.warps * config.unroll * CHUNK_BYTES + staged_token_bytes(config, staged_token_tiles) +
            (ARRIVAL_BYTES if config.splits > 1 else 0))


def column_b_staged_smem_bytes(config: SkinnyConfig, m_tiles: int) -> int:
    """Dynamic shared memory of the column-major-B kernel with staged tokens (then all of its shared memory is
    dynamic): every warp's token stages (reused for its partial tile) and, with split K, the arrival count."""
    return staged_token_bytes(config, m_tiles) + (ARRIVAL_BYTES if config.splits > 1 else 0)
