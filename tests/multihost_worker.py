"""One process of the 2-process x 4-device CPU test (tests/test_sharding.py).

Environment: DEEPINFER_COORDINATOR (host:port), DEEPINFER_NUM_PROCESSES, DEEPINFER_PROCESS_ID,
DEEPINFER_OUT (where process 0 writes the gathered logits). Uses JAX's own distributed runtime
(`jax.distributed.initialize`) with gloo CPU collectives.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=os.environ["DEEPINFER_COORDINATOR"],
                           num_processes=int(os.environ["DEEPINFER_NUM_PROCESSES"]),
                           process_id=int(os.environ["DEEPINFER_PROCESS_ID"]))

import deepinfer_fn as di  # noqa: E402
import shardings  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

assert jax.device_count() == 8 and jax.local_device_count() == 4, jax.devices()
golden = os.path.join(os.path.dirname(__file__), "golden", "cfg_a")
mesh = shardings.make_mesh(dp=2, ep=4)
params = di.load_params(golden, mesh=mesh)
from deepinfer_fn.checkpoint.safetensors_io import SafetensorsFile  # noqa: E402
ids = np.array(SafetensorsFile(os.path.join(golden, "reference.safetensors")).get("input_ids"))
tokens = np.concatenate([ids] * 4, 0)  # 8 rows: one per device
logits = di.forward(params, tokens)
full = multihost_utils.process_allgather(logits, tiled=True)
if jax.process_index() == 0:
    np.save(os.environ["DEEPINFER_OUT"], np.asarray(full))
print(f"process {jax.process_index()} done", flush=True)
