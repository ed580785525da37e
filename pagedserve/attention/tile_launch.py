"""The launch of a tiled attention kernel (the paged prefill kernel's, the unified kernel's) as a
switch: '+'-joined parts bmN (rows of a query tile, the M of tl.dot), bnN (context positions per
K/V tile), wN (warps), sN (pipeline stages), plus the flags a kernel names (the prefill kernel's
gqa, lpt, tma and ws), e.g. bm128+bn64+w8+s3. Each part changes one field of the kernel's default launch; an empty
string is the default. One parser serves every such switch, so their grammars cannot drift apart.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

NUMBERED = {"bm": "block_m", "bn": "block_n", "w": "num_warps", "s": "num_stages"}


@dataclass(frozen=True)
class TileLaunch:
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    gqa: bool = False  # the prefill kernel's GQA-packed variant (triton_prefill.py)
    lpt: bool = False  # the prefill kernel's query tiles start last (longest) first
    tma: bool = False  # the prefill kernel's K/V tiles by TMA, one page each (block size % bn == 0)
    ws: bool = False   # the prefill kernel's tile loop warp-specialised (with tma; Hopper/Blackwell)

    def name(self, flags: tuple[str, ...] = ()) -> str:
        """The switch string that parses back to this launch (flags: the ones the kernel takes)."""
        text = f"bm{self.block_m}+bn{self.block_n}+w{self.num_warps}+s{self.num_stages}"
        return text + "".join(f"+{f}" for f in flags if getattr(self, f))


def parse_tile_launch(text: str, env: str, default: TileLaunch, flags: tuple[str, ...] = ()) -> TileLaunch:
    """`text` (the switch `env`'s value) as changes to `default`; flags: the boolean fields this
    kernel takes by name. Any other part, a zero, or a tile size that is not a power of two >= 16
    is a ValueError naming `env`."""
    kw: dict = {}
    for part in filter(None, text.strip().split("+")):
        key = part.rstrip("0123456789")
        number = part[len(key):]
        if part in flags:
            kw[part] = True
        elif key in NUMBERED and number and int(number) >= 1:
            kw[NUMBERED[key]] = int(number)
        else:
            names = ", ".join(["bmN", "bnN", "wN", "sN", *flags])
            raise ValueError(f"{env} parts are {names} joined by '+', got {part!r} in {text!r}")
    launch = dataclasses.replace(default, **kw)
    for field in ("block_m", "block_n"):
        v = getattr(launch, field)
        if v < 16 or v & (v - 1):
            raise ValueError(f"{env}: {field} must be a power of two >= 16, got {v}")
    return launch
