"""What crosses between the ranks of mixkv.tp: request layouts and plans as
plain values (plans bit for bit), configs compared by content, and the
digests the ranks compare."""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Optional

from ._core import Precision, PrecisionPlan, Segment, TokenKind, TokenLayout

# The buffer of a step's broadcast: a step's calls (a few hundred bytes a
# request) and a small payload fit, so most steps cost one collective.
INLINE_BYTES = 4096


def describe(value: Any, depth: int = 0) -> Any:
    """A config object as plain values (its public attributes, recursively),
    so that two processes' configs compare by content, not by address."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [describe(v, depth + 1) for v in value]
    if depth > 4:  # the configs nest two levels deep; deeper is a cycle
        return repr(value)
    fields = {}
    for name in sorted(dir(value)):
        if name.startswith("_"):
            continue
        attribute = getattr(value, name)
        if not callable(attribute):
            fields[name] = describe(attribute, depth + 1)
    return fields if fields else repr(value)


def layout_state(layout: TokenLayout) -> list:
    return [(int(s.kind), int(s.length)) for s in layout.segments]


def layout_of(state: list) -> TokenLayout:
    return TokenLayout([Segment(TokenKind(kind), length) for kind, length in state])


def plan_state(plan: Optional[PrecisionPlan]) -> Optional[tuple]:
    """A plan as (layers, windows, precisions row-major, scores): its scores
    travel bit for bit (float32 through a Python float), since demotion
    under pressure orders windows by them."""
    if plan is None:
        return None
    layers, windows = plan.num_layers, plan.num_windows
    precisions = bytes(int(plan.at(layer, w)) for layer in range(layers) for w in range(windows))
    return (layers, windows, precisions, [plan.score(w) for w in range(windows)])


def plan_of(state: Optional[tuple]) -> Optional[PrecisionPlan]:
    if state is None:
        return None
    layers, windows, precisions, scores = state
    plan = PrecisionPlan(layers, windows)
    for i, p in enumerate(precisions):
        if p != int(Precision.FP16):
            plan.set(i // windows, i % windows, Precision(p))
    for w, score in enumerate(scores):
        plan.set_score(w, score)
    return plan


def signed64(value: int) -> int:
    """An unsigned 64-bit digest as the int64 a tensor holds."""
    return value - (1 << 64) if value >= 1 << 63 else value


def text_digest(text: str) -> int:
    return signed64(int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little"))


def first_difference(texts: list) -> str:
    """Where the ranks' describe_state() texts first differ, for the message."""
    lines = [t.splitlines() for t in texts]
    for r in range(1, len(lines)):
        if lines[r] == lines[0]:
            continue
        for i in range(max(len(lines[0]), len(lines[r]))):
            a = lines[0][i] if i < len(lines[0]) else "<end>"
            b = lines[r][i] if i < len(lines[r]) else "<end>"
            if a != b:
                return f"describe_state() line {i + 1}: rank 0 {a!r}, rank {r} {b!r}"
    return "describe_state() equal on every rank (the steps themselves differ)"


def broadcast_bytes(torch: Any, blob: Optional[bytes], broadcast: Callable[[Any], None]) -> bytes:
    """The leader's bytes (``blob``; None on the other ranks) on every rank:
    one ``broadcast`` of a fixed-size uint8 buffer when they fit in it (a
    step's calls and a small payload do), a second one for the rest
    otherwise; each rank learns from the first which case it is."""
    header = torch.zeros(INLINE_BYTES, dtype=torch.uint8)
    if blob is not None:
        size = len(blob)
        header[:8] = torch.frombuffer(bytearray(size.to_bytes(8, "little")), dtype=torch.uint8)
        inline = min(size, INLINE_BYTES - 8)
        if inline:
            header[8 : 8 + inline] = torch.frombuffer(bytearray(blob[:inline]), dtype=torch.uint8)
    broadcast(header)
    size = int.from_bytes(header[:8].numpy().tobytes(), "little")
    inline = min(size, INLINE_BYTES - 8)
    if size == inline:
        return header[8 : 8 + size].numpy().tobytes()
    rest = torch.zeros(size - inline, dtype=torch.uint8)
    if blob is not None:
        rest[:] = torch.frombuffer(bytearray(blob[inline:]), dtype=torch.uint8)
    broadcast(rest)
    return header[8 : 8 + inline].numpy().tobytes() + rest.numpy().tobytes()
