"""Which tensor-parallel pairings our P/D connectors serve, and which heads move where.

Each engine's rank ``r`` of ``n`` holds KV heads ``[r * H / n, (r + 1) * H / n)`` of the model's
``H`` KV heads (vLLM's split); each rank's side channel is at ``side_channel_port + r``.

* **Same TP size**: decode rank ``r`` pairs with prefill rank ``r`` and moves whole blocks
  (READ and WRITE; also for caches that are not split by heads, as MLA's or Mamba state).
* **Different TP sizes, READ**: decode rank ``q`` reads, from every prefill rank whose heads
  overlap its own, the overlapping heads, into their place in its own blocks
  (:func:`head_slices`): one source rank when decode has more ranks (a slice of that rank's
  heads), several when prefill has more (each one's whole heads into a slice of the local
  block). A prefill rank frees a request's blocks once every decode rank that reads it
  (:func:`reader_ranks`) said done. This needs every cache's blocks to hold each head's bytes
  contiguously (vLLM's head-major layout, the CPU backend's ``[blocks, heads, block_size, ...]``);
  the worker refuses other layouts at handshake (``layout.py``).
* **Different TP sizes, WRITE**: the same head slices the other way: each prefill rank writes,
  into every decode rank whose heads overlap its own (:func:`reader_ranks`), those heads in
  their place in the decode blocks the rank offered; each decode rank waits for the "written"
  notice of every prefill rank that holds heads of its own (:func:`source_ranks`).
* **Mamba2 state between TP sizes** (hybrid models): vLLM splits a Mamba2 layer's state page
  by heads too, in three parts of the conv state (``x | B | C`` channels) and the SSM state's
  heads, each split evenly over the ranks, except ``B`` and ``C`` where the TP size does not
  divide the groups (one group: every rank holds it). A decode rank takes from each prefill
  rank it reads (the same ranks as for the KV heads) the spans of each part it holds
  (:func:`state_page_spans`); a replicated part from the first of them only.
* Refused (:func:`tp_refusal`): sizes that do not split the model's KV heads evenly (more
  ranks than KV heads included: those ranks replicate heads), and state other than Mamba2's
  (:class:`Mamba2State`: Mamba1, gated delta nets, linear attention, short convolutions,
  vLLM's ReplaySSM rings), or Mamba2 state the two sides lay out differently
  (:func:`state_refusal`).

The supported matrix is in the connectors' README.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from vllm_pd_ext.transfer_params import READ, WRITE

#: The transfer modes that move head slices between engines of different TP sizes.
MODES = (READ, WRITE)


@dataclass(frozen=True)
class HeadSlice:
    """Heads ``[remote_start, remote_start + count)`` of prefill rank ``remote_rank`` are
    heads ``[local_start, local_start + count)`` of the local rank (indices within each rank's
    own heads)."""

    remote_rank: int
    remote_start: int
    local_start: int
    count: int


def tp_refusal(
    prefill_tp: object,
    decode_tp: object,
    *,
    mode: str = READ,
    kv_heads: int | None = None,
    state: bool = False,
) -> str | None:
    """Why a prefill engine of TP size ``prefill_tp`` and a decode engine of ``decode_tp``
    cannot exchange KV in ``mode`` for a model of ``kv_heads`` KV heads (None: not known
    here, the sizes alone are checked) that keeps per-request ``state`` (SSM pages, not
    split like KV heads), or None when they can."""
    if prefill_tp == decode_tp:
        return None
    sizes = f"prefill TP {prefill_tp}, decode TP {decode_tp}"
    if not isinstance(prefill_tp, int) or not isinstance(decode_tp, int):
        return f"tensor parallel sizes differ ({sizes}) and one is not a number"
    if prefill_tp < 1 or decode_tp < 1:
        return f"tensor parallel sizes differ ({sizes}) and one is below 1"
    if mode not in MODES:
        return f"tensor parallel sizes differ ({sizes}) and {mode!r} is no transfer mode"
    if state:
        return (
            f"tensor parallel sizes differ ({sizes}) and the model keeps SSM state other than "
            "Mamba2's (only Mamba2 state pages are split by heads here), which moves only "
            "between engines with the same --tensor-parallel-size"
        )
    if kv_heads is not None:
        for side, n in (("prefill", prefill_tp), ("decode", decode_tp)):
            if n > kv_heads:
                return (
                    f"tensor parallel sizes differ ({sizes}) and {side} TP {n} is more than "
                    f"the model's {kv_heads} KV heads (its ranks replicate heads): use the "
                    "same --tensor-parallel-size on both sides"
                )
            if kv_heads % n:
                return (
                    f"tensor parallel sizes differ ({sizes}) and {side} TP {n} does not "
                    f"divide the model's {kv_heads} KV heads"
                )
    return None


def _overlap(a: int, a_tp: int, b: int, b_tp: int) -> bool:
    """Whether rank ``a`` of ``a_tp`` and rank ``b`` of ``b_tp`` hold a common head (any
    number of heads both sizes divide)."""
    return a * b_tp < (b + 1) * a_tp and b * a_tp < (a + 1) * b_tp


def source_ranks(rank: int, tp_size: int, remote_tp: int) -> list[int]:
    """The prefill ranks (of ``remote_tp``) decode rank ``rank`` (of ``tp_size``) reads."""
    return [r for r in range(remote_tp) if _overlap(rank, tp_size, r, remote_tp)]


def reader_ranks(rank: int, tp_size: int, decode_tp: int) -> list[int]:
    """The decode ranks (of ``decode_tp``) that read prefill rank ``rank`` (of ``tp_size``)."""
    return [q for q in range(decode_tp) if _overlap(q, decode_tp, rank, tp_size)]


def head_slices(rank: int, tp_size: int, remote_tp: int, kv_heads: int) -> list[HeadSlice]:
    """What decode rank ``rank`` of ``tp_size`` reads from each prefill rank of ``remote_tp``
    for a cache of ``kv_heads`` heads in all; ``ValueError`` when a size does not divide it."""
    if refusal := tp_refusal(remote_tp, tp_size, kv_heads=kv_heads):
        raise ValueError(refusal)
    mine, theirs = kv_heads // tp_size, kv_heads // remote_tp
    lo, hi = rank * mine, (rank + 1) * mine
    out = []
    for r in source_ranks(rank, tp_size, remote_tp):
        start, stop = max(lo, r * theirs), min(hi, (r + 1) * theirs)
        out.append(HeadSlice(r, start - r * theirs, start - lo, stop - start))
    return out


def rank_refusal(ours: int, theirs: object, expected: int | None = None) -> str | None:
    """Why a peer that says it is TP rank ``theirs`` cannot be the rank ``expected`` (by
    default ``ours``, the same rank) that our rank ``ours`` meant to reach (a side-channel
    port of another engine's rank answered), or None when it can."""
    want = ours if expected is None else expected
    if theirs == want:
        return None
    meant = "" if want == ours else f" (it meant to reach rank {want})"
    return (
        f"TP rank {ours} reached a peer that is TP rank {theirs}{meant}: each engine's "
        "side_channel_port needs its TP size in consecutive free ports"
    )


def total_kv_heads(vllm_config: Any) -> int | None:
    """The model's KV heads across all ranks (None when the config cannot say)."""
    try:
        return int(vllm_config.model_config.get_total_num_kv_heads())
    except (AttributeError, TypeError, ValueError):
        return None


#: The parts of a Mamba2 conv state, in their order in each rank's channels.
CONV_PARTS = ("x", "B", "C")


@dataclass(frozen=True)
class Mamba2State:
    """One TP rank's Mamba2 state page, as vLLM shapes it (``MambaStateShapeCalculator.
    mamba2_state_shape``) and packs it (conv state, then SSM state, in one page): the conv
    state holds ``conv_rows`` past inputs of ``x | B | C`` channels (``x``: this rank's
    ``heads * head_dim``; ``B`` and ``C``: ``groups * state_size`` each), channels outermost
    when ``channels_first`` (vLLM's ``DS`` conv layout), innermost otherwise (``SD``); the SSM
    state is ``heads x head_dim x state_size``. ``heads`` and ``groups`` are this rank's: the
    model's split evenly, or for groups the TP size does not divide (vLLM allows that for one
    group only), all of them on every rank."""

    tp_size: int
    heads: int
    head_dim: int
    state_size: int
    groups: int
    conv_rows: int
    channels_first: bool
    conv_itemsize: int
    ssm_itemsize: int

    @classmethod
    def from_shapes(
        cls,
        shapes: Sequence[Sequence[int]],
        itemsizes: Sequence[int],
        *,
        tp_size: int,
        channels_first: bool,
    ) -> Mamba2State:
        """From a ``MambaSpec``'s ``shapes`` and its dtypes' ``itemsizes`` (one rank's);
        ``ValueError`` when they are not one conv state and one SSM state of Mamba2."""
        if len(shapes) != 2 or len(itemsizes) != 2:
            raise ValueError(f"{len(shapes)} state shapes, not Mamba2's conv and SSM state")
        conv, ssm = (tuple(int(n) for n in shape) for shape in shapes)
        if len(conv) != 2 or len(ssm) != 3:
            raise ValueError(f"state shapes {conv} and {ssm} are not Mamba2's")
        channels, rows = conv if channels_first else conv[::-1]
        heads, head_dim, state_size = ssm
        rest = channels - heads * head_dim
        if rest <= 0 or rest % (2 * state_size):
            raise ValueError(
                f"conv state of {channels} channels is not {heads} x {head_dim} x-channels "
                f"and two parts of groups x {state_size}"
            )
        return cls(
            tp_size=tp_size,
            heads=heads,
            head_dim=head_dim,
            state_size=state_size,
            groups=rest // (2 * state_size),
            conv_rows=rows,
            channels_first=channels_first,
            conv_itemsize=int(itemsizes[0]),
            ssm_itemsize=int(itemsizes[1]),
        )

    @property
    def channels(self) -> int:
        """Conv state channels of this rank (``x``, ``B`` and ``C``)."""
        return self.heads * self.head_dim + 2 * self.groups * self.state_size

    @property
    def conv_bytes(self) -> int:
        """Bytes of the conv state (the SSM state follows it in the page)."""
        return self.channels * self.conv_rows * self.conv_itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of the state in the page (vLLM may pad the page beyond them)."""
        return self.conv_bytes + self.heads * self.head_dim * self.state_size * self.ssm_itemsize

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Mamba2State:
        ints = {k: int(d[k]) for k in cls.__dataclass_fields__ if k != "channels_first"}
        return cls(channels_first=bool(d["channels_first"]), **ints)


def total_groups(a: Mamba2State, b: Mamba2State) -> int | None:
    """The model's groups, as two sides' ranks hold them (None: no count fits both). A rank
    holding one group holds the model's one (replicated) or its share of ``tp_size`` groups;
    two different TP sizes leave one count that fits both."""
    if a.tp_size == b.tp_size:  # rank r holds what rank r holds: the count does not matter
        return a.groups * a.tp_size if a.groups == b.groups else None
    fits = [{s.groups * s.tp_size} | ({1} if s.groups == 1 else set()) for s in (a, b)]
    both = fits[0] & fits[1]
    return both.pop() if len(both) == 1 else None


def state_refusal(local: Mamba2State, remote: Mamba2State) -> str | None:
    """Why the Mamba2 state pages of two engines' ranks cannot be assembled from one another
    (``local`` one of ours, ``remote`` one of the peer's), or None when they can."""
    for name in ("head_dim", "state_size", "conv_rows", "channels_first"):
        a, b = getattr(local, name), getattr(remote, name)
        if a != b:
            return f"Mamba2 state {name}: {a!r} here, {b!r} remote"
    for name in ("conv_itemsize", "ssm_itemsize"):
        a, b = getattr(local, name), getattr(remote, name)
        if a != b:
            return f"Mamba2 state {name}: {a} bytes here, {b} remote"
    heads, remote_heads = local.heads * local.tp_size, remote.heads * remote.tp_size
    if heads != remote_heads:
        return (
            f"Mamba2 state of {heads} SSM heads in all here ({local.heads} x TP "
            f"{local.tp_size}), {remote_heads} remote ({remote.heads} x TP {remote.tp_size})"
        )
    if total_groups(local, remote) is None:
        return (
            f"Mamba2 state groups do not fit both sides ({local.groups} per rank at TP "
            f"{local.tp_size} here, {remote.groups} at TP {remote.tp_size} remote)"
        )
    return None


def _held(s: Mamba2State, rank: int, groups: int) -> list[tuple[int, int, int, int]]:
    """The model's parts rank ``rank`` of ``s`` holds, per part (``x``, ``B``, ``C``, SSM
    heads): ``(first unit, units, unit length, where the part starts)``: ``x`` in channels,
    ``B`` and ``C`` in groups of ``state_size`` channels, both at their channel in the conv
    state; heads at their byte in the page."""
    x = s.heads * s.head_dim
    first_group = rank * s.groups if s.groups * s.tp_size == groups else 0
    return [
        (rank * x, x, 1, 0),
        (first_group, s.groups, s.state_size, x),
        (first_group, s.groups, s.state_size, x + s.groups * s.state_size),
        (rank * s.heads, s.heads, s.head_dim * s.state_size * s.ssm_itemsize, s.conv_bytes),
    ]


def _byte_spans(
    local: Mamba2State, remote: Mamba2State, part: int, at: int, from_: int, channels: int
) -> list[tuple[int, int, int]]:
    """Byte spans of ``channels`` conv channels at channel ``at`` of ours and ``from_`` of
    theirs (``part`` 3: bytes of SSM heads, already in bytes)."""
    if part == 3:
        return [(at, from_, channels)]
    size = local.conv_itemsize
    if local.channels_first:
        rows = local.conv_rows
        return [(at * rows * size, from_ * rows * size, channels * rows * size)]
    return [
        ((t * local.channels + at) * size, (t * remote.channels + from_) * size, channels * size)
        for t in range(local.conv_rows)
    ]


def state_page_spans(
    local: Mamba2State, rank: int, remote: Mamba2State, sources: Sequence[int]
) -> dict[int, list[tuple[int, int, int]]]:
    """What rank ``rank`` of ``local`` takes from each rank in ``sources`` (of ``remote``, its
    source ranks: :func:`source_ranks`): ``(local offset, remote offset, length)`` byte spans
    within one state page, per source rank. Each part it holds comes from the first source
    that holds it (a replicated ``B`` / ``C`` from the first only); ``ValueError`` when the
    pages do not fit (:func:`state_refusal`) or the sources miss some of it."""
    if refusal := state_refusal(local, remote):
        raise ValueError(refusal)
    groups = total_groups(local, remote)
    assert groups is not None
    out: dict[int, list[tuple[int, int, int]]] = {r: [] for r in sources}
    for part, (lo, n, unit, base) in enumerate(_held(local, rank, groups)):
        cursor = lo
        for r in sorted(sources):
            r_lo, r_n, _, r_base = _held(remote, r, groups)[part]
            start, stop = max(cursor, r_lo), min(lo + n, r_lo + r_n)
            if stop <= start:
                continue
            out[r] += _byte_spans(
                local,
                remote,
                part,
                base + (start - lo) * unit,
                r_base + (start - r_lo) * unit,
                (stop - start) * unit,
            )
            cursor = stop
        if cursor != lo + n:
            raise ValueError(
                f"TP rank {rank} of {local.tp_size} holds Mamba2 state "
                f"{(*CONV_PARTS, 'heads')[part]} units {cursor}..{lo + n} that none of the "
                f"ranks {list(sources)} of TP {remote.tp_size} holds"
            )
    return out
