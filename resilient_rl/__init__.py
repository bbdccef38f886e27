"""resilient-rl: a fault-tolerant, long-running RL trainer for language models on Ray and FSDP2.

The single-controller runtime is exported here under verl's names, so a verl worker ports by
changing its imports::

    from resilient_rl import Worker, register, Dispatch, RayResourcePool, RayClassWithInitArgs, RayWorkerGroup

The exports are loaded on first use (:mod:`resilient_rl.lazy`): ``import resilient_rl`` alone
imports neither torch nor Ray, so commands that only read a run folder start at once.
"""

from resilient_rl.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "resilient_rl.runtime.dispatch": (
        "Dispatch", "Execute", "collect_all_to_all", "collect_dp_compute", "collect_dp_compute_data_proto",
        "collect_rank_zero", "dispatch_all_to_all", "dispatch_dp_compute", "dispatch_dp_compute_data_proto",
        "dispatch_dp_compute_data_proto_with_func", "dispatch_one_to_all", "dispatch_rank_zero",
        "get_predefined_dispatch_fn", "register", "register_dispatch_mode", "update_dispatch_mode"),
    "resilient_rl.runtime.dispatch_nd": ("make_nd_compute_dataproto_dispatch_fn",),
    "resilient_rl.runtime.resource_pool": (
        "RayResourcePool", "SubRayResourcePool", "merge_resource_pool", "split_resource_pool"),
    "resilient_rl.runtime.verl_worker": ("Worker",),
    "resilient_rl.runtime.worker_class": ("create_colocated_worker_cls_fused", "create_colocated_worker_raw_cls"),
    "resilient_rl.runtime.worker_group": ("RayClassWithInitArgs", "RayWorkerGroup", "create_colocated_worker_cls"),
    "resilient_rl.errors": ("RRLError",),
    "resilient_rl.protocol": (
        "DataProto", "DataProtoConfig", "DataProtoFuture", "DataProtoItem", "deserialize_single_tensor",
        "deserialize_tensordict", "fold_batch_dim", "pad_dataproto_to_divisor", "serialize_single_tensor",
        "serialize_tensordict", "unfold_batch_dim", "union_numpy_dict", "union_tensor_dict", "unpad_dataproto"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [name for names in _EXPORTS.values() for name in names] + ["__version__"]
