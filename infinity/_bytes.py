"""What the tensors of a run take, in bytes: the formulas the memory plan (`_admission`), the
disk footprint (`_footprint`), the overlaps (`_overlap`, `_overlap_host`) and the estimate
(`_estimate`) share, so that each asks one place.

Owns: the bytes of the state a run keeps on nvme under its real names, of what an early update
stages (on disk, in the pool, in host memory), per sub-group. Touches: the sub-groups and state
records (`_substates.SubGroupStates`, called ``states`` here), read only. (The step's own pool
bytes depend on how far it reads ahead: `_update.step_bytes`.)
"""

from __future__ import annotations

from infinity.swap import ALIGNMENT, round_up


def state_tensors(layout) -> dict[str, list[int]]:
    """Bytes of each tensor the run of ``layout`` (a `_layout.Layout`) keeps on nvme under its
    real name, by kind of state ("params", "grads", "optimizer"; the kinds not on nvme absent)."""
    st, sizes = layout.states, {}
    if layout.param_store.tier == "nvme":
        whole = st.gather_params
        sizes["params"] = [(u.padded_numel if whole else u.shard_numel) * layout.dtype.itemsize for u in layout.units]
    if layout.grad_store.tier == "nvme":
        # frozen units (a LoRA's base) never get a gradient written
        sizes["grads"] = [(u.padded_numel if layout.grads_full else u.shard_numel) * 4
                          for u in layout.units if u.trainable]  # fmt: skip
    if st.stores["master"].tier == "nvme":
        kinds = st.kinds[1:] if st.one_copy else st.kinds  # one copy: the master weights are the params
        sizes["optimizer"] = [g.record.nbytes(k) for g in st.groups for k in kinds]
    return sizes


def staged_tensors(states, sg) -> list[int]:
    """Bytes of each tensor an early update of sub-group ``sg`` stages on nvme (see [Note:
    exact overlap] in `_overlap`): its states, and its units' new parameters."""
    kinds = states.kinds[1:] if states.one_copy else states.kinds  # one copy: the staged params are the master weights
    return [sg.record.nbytes(k) for k in kinds] + staged_params(states, sg)


def staged_params(states, sg) -> list[int]:
    """Bytes of each new parameter of sub-group ``sg`` staged on nvme: the nvme overlap's, and
    the host overlap's ([Note: parameters written under backward] in `_overlap_host`)."""
    return [states.record(u).nbytes("param") for u in sg.units]


def staged_disk_bytes(states, sg, members: int) -> int:
    """Disk bytes an early update of ``sg`` takes at most over ``members`` drives: its staged
    tensors, each piece aligned (a striped one is cut into a piece per drive)."""
    return sum(round_up(n, ALIGNMENT) + (members - 1) * ALIGNMENT for n in staged_tensors(states, sg))


def group_bytes(states, sg) -> int:
    """Pool bytes an early update of ``sg`` holds with its states on nvme: its states and
    gradients read, the copies of its new parameters written."""
    params = 0 if states.one_copy else sum(staged_params(states, sg))
    return sg.record.state_bytes(states.kinds) + 4 * sg.numel + params  # the gradients are fp32


def host_staged_bytes(states, sg) -> int:
    """Host bytes an early update of ``sg`` stages with its states in host memory: a copy of
    each of its states, and its units' new parameters."""
    return sg.record.state_bytes(states.kinds) + sum(staged_params(states, sg))
