"""resilient-rl: a fault-tolerant, long-running RL trainer for language models on Ray and FSDP2.

The single-controller runtime is exported here under verl's names, so a verl worker ports by
changing its imports::

    from resilient_rl import Worker, register, Dispatch, RayResourcePool, RayClassWithInitArgs, RayWorkerGroup
"""

from resilient_rl.runtime.dispatch import (
    Dispatch,
    Execute,
    collect_all_to_all,
    collect_dp_compute,
    collect_dp_compute_data_proto,
    collect_rank_zero,
    dispatch_all_to_all,
    dispatch_dp_compute,
    dispatch_dp_compute_data_proto,
    dispatch_dp_compute_data_proto_with_func,
    dispatch_one_to_all,
    dispatch_rank_zero,
    get_predefined_dispatch_fn,
    register,
    register_dispatch_mode,
    update_dispatch_mode,
)
from resilient_rl.runtime.dispatch_nd import make_nd_compute_dataproto_dispatch_fn
from resilient_rl.runtime.resource_pool import (RayResourcePool, SubRayResourcePool, merge_resource_pool,
                                                   split_resource_pool)
from resilient_rl.runtime.worker import Worker
from resilient_rl.runtime.worker_class import create_colocated_worker_cls_fused, create_colocated_worker_raw_cls
from resilient_rl.runtime.worker_group import (
    RayClassWithInitArgs,
    RayWorkerGroup,
    create_colocated_worker_cls,
)
from resilient_rl.errors import RRLError
from resilient_rl.protocol import (
    DataProto,
    DataProtoConfig,
    DataProtoFuture,
    DataProtoItem,
    deserialize_single_tensor,
    deserialize_tensordict,
    fold_batch_dim,
    pad_dataproto_to_divisor,
    serialize_single_tensor,
    serialize_tensordict,
    unfold_batch_dim,
    union_numpy_dict,
    union_tensor_dict,
    unpad_dataproto,
)

__version__ = "0.1.0"

__all__ = [
    "DataProto", "DataProtoConfig", "DataProtoFuture", "DataProtoItem", "pad_dataproto_to_divisor", "unpad_dataproto",
    "fold_batch_dim", "unfold_batch_dim", "union_tensor_dict", "union_numpy_dict", "serialize_single_tensor",
    "deserialize_single_tensor", "serialize_tensordict", "deserialize_tensordict",
    "Worker", "register", "Dispatch", "Execute",
    "RayResourcePool", "merge_resource_pool", "RayClassWithInitArgs", "RayWorkerGroup", "create_colocated_worker_cls",
    "collect_all_to_all", "collect_dp_compute", "collect_dp_compute_data_proto", "collect_rank_zero",
    "dispatch_all_to_all", "dispatch_dp_compute", "dispatch_dp_compute_data_proto",
    "dispatch_dp_compute_data_proto_with_func", "dispatch_one_to_all", "dispatch_rank_zero",
    "get_predefined_dispatch_fn", "register_dispatch_mode", "update_dispatch_mode",
    "make_nd_compute_dataproto_dispatch_fn", "SubRayResourcePool", "split_resource_pool",
    "create_colocated_worker_cls_fused", "create_colocated_worker_raw_cls", "RRLError", "__version__",
]
