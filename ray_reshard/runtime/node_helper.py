"""One helper actor per node: topology (NVLink domain) discovery and shared-memory ring lifetime.

The helper creates the rings that ranks on its node use to exchange data with each other (as
named segments under /dev/shm), and removes their names once every rank has mapped them
(:meth:`NodeHelper.seal`): from then on the memory lives exactly as long as the processes that map
it, so nothing can leak even if they crash. Before ``seal`` the names are the helper's: it unlinks
them in :meth:`NodeHelper.destroy_group`, in its destructor and at exit (best effort: a helper
killed with SIGKILL before ``seal`` leaves its unsealed segments behind).

Domains: a helper reports the NVLink domain of its node and of each GPU on it. On GPUs that belong
to an NVLink fabric (GB200 NVL72 and similar) that is the fabric's cluster UUID and clique id read
through NVML; otherwise (PCIe or NVLink within one node, CPU-only nodes) it is the node id. The
``RAY_RESHARD_DOMAIN`` environment variable, when set in the helper's process, overrides both;
:func:`start_node_helpers` sets it per node through ``domains=`` (tests use this to simulate several
domains on one machine).
"""
from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys
import weakref
from typing import Any, Dict, List, Mapping, Optional

import ray

from .transport.segment import SHM_DIR, segment_exists
from .transport.shm import ShmRing

__all__ = ["NodeHelper", "start_node_helpers", "discover_actor_info", "DOMAIN_ENV",
           "gpu_inventory", "fabric_domain_of", "FabricInfo", "FabricInfoV2"]

DOMAIN_ENV = "RAY_RESHARD_DOMAIN"


# ---- GPU / NVLink discovery (NVML, best effort) -------------------------------------------------

class FabricInfo(ctypes.Structure):
    """NVML's nvmlGpuFabricInfo_t (nvmlDeviceGetGpuFabricInfo), laid out as in nvml.h.

    Not pynvml's c_nvmlGpuFabricInfo_t: that one declares an 80-byte UUID (the device UUID
    string size) where NVML writes 16 bytes, so every field after it is read at the wrong offset.
    """

    _fields_ = [("clusterUuid", ctypes.c_ubyte * 16), ("status", ctypes.c_int),
                ("cliqueId", ctypes.c_uint), ("state", ctypes.c_ubyte)]


class FabricInfoV2(ctypes.Structure):
    """NVML's nvmlGpuFabricInfo_v2_t (nvmlDeviceGetGpuFabricInfoV, version field first)."""

    _fields_ = [("version", ctypes.c_uint), ("clusterUuid", ctypes.c_ubyte * 16),
                ("status", ctypes.c_int), ("cliqueId", ctypes.c_uint),
                ("state", ctypes.c_ubyte), ("healthMask", ctypes.c_uint)]


FABRIC_INFO_V2 = ctypes.sizeof(FabricInfoV2) | (2 << 24)     # NVML_STRUCT_VERSION(GpuFabricInfo, 2)
FABRIC_STATE_COMPLETED = 3                                   # NVML_GPU_FABRIC_STATE_COMPLETED


def fabric_domain_of(cluster_uuid: bytes, status: int, clique_id: int, state: int) -> Optional[str]:
    """The domain name of one GPU's fabric registration, or None when it has none."""
    if int(state) != FABRIC_STATE_COMPLETED or int(status) != 0 or not any(cluster_uuid):
        return None
    return f"nvl-{bytes(cluster_uuid).hex()}-{int(clique_id)}"


def _fabric_domain(nvml, handle) -> Optional[str]:
    """The NVLink fabric domain of one GPU ("nvl-<cluster uuid>-<clique>"), or None.

    Calls NVML's C functions with structs laid out as in nvml.h (the versioned one first, then
    the legacy one); a driver or GPU without fabric support answers None."""
    get = getattr(nvml, "_nvmlGetFunctionPointer", None)
    if get is None:
        return None
    v2 = FabricInfoV2()
    v2.version = FABRIC_INFO_V2
    for name, info in (("nvmlDeviceGetGpuFabricInfoV", v2),
                       ("nvmlDeviceGetGpuFabricInfo", FabricInfo())):
        try:
            rc = get(name)(handle, ctypes.byref(info))
        except Exception:
            continue            # no such function in this driver
        if rc != 0:
            continue            # not supported by this GPU/driver (or an older struct version)
        return fabric_domain_of(bytes(info.clusterUuid), info.status, info.cliqueId, info.state)
    return None


def gpu_inventory() -> List[Dict[str, Any]]:
    """Every GPU of this node per NVML: [{"index", "uuid", "fabric"}]; [] without NVML/GPUs.

    NVML ignores CUDA_VISIBLE_DEVICES, so this lists the node's GPUs whatever the calling
    process was given. ``index`` is NVML's; match GPUs by ``uuid``.
    """
    try:
        import pynvml as nvml
    except Exception:
        return []
    try:
        nvml.nvmlInit()
    except Exception:
        return []
    out = []
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            uuid = nvml.nvmlDeviceGetUUID(h)
            if isinstance(uuid, bytes):
                uuid = uuid.decode()
            out.append({"index": i, "uuid": _norm_uuid(uuid), "fabric": _fabric_domain(nvml, h)})
    except Exception:
        pass
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    return out


def _norm_uuid(uuid: Any) -> str:
    """GPU UUIDs as NVML prints them: "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"."""
    s = str(uuid)
    return s if s.startswith(("GPU-", "MIG-")) else f"GPU-{s}"


def node_topology(node_id: str) -> Dict[str, Any]:
    """The topology of the calling process's node (what NodeHelper.topology returns)."""
    override = os.environ.get(DOMAIN_ENV) or None
    gpus = gpu_inventory()
    fabrics = [g["fabric"] for g in gpus if g["fabric"]]
    if override:
        domain = override
    elif fabrics:
        domain = max(set(fabrics), key=fabrics.count)   # a node's GPUs normally share one
    else:
        domain = node_id
    try:
        ip = ray.util.get_node_ip_address()
    except Exception:
        ip = None
    return {
        "node_id": node_id,
        "ip": ip,
        "hostname": socket.gethostname(),
        "domain": domain,
        "gpus": [{"index": g["index"], "uuid": g["uuid"],
                  "domain": override or g["fabric"] or node_id} for g in gpus],
    }


# ---- inside any actor ---------------------------------------------------------------------------

def discover_actor_info() -> Dict[str, Any]:
    """Where the calling actor runs: node, pid, Ray GPU ids, torch device, GPU UUID.

    Meant to run inside an actor, e.g.
    ``actor.__ray_call__.remote(lambda self: discover_actor_info())``.
    """
    ctx = ray.get_runtime_context()
    try:
        gpu_ids = list(ray.get_gpu_ids())
    except Exception:
        gpu_ids = []
    device, uuid = "cpu", None
    if gpu_ids:
        try:
            import torch
            if torch.cuda.is_available():
                idx = torch.cuda.current_device()
                device = f"cuda:{idx}"
                try:
                    uuid = _norm_uuid(torch.cuda.get_device_properties(idx).uuid)
                except Exception:
                    uuid = None
        except Exception:
            pass
        if uuid is None and device != "cpu":
            uuid = _uuid_by_ray_gpu_id(gpu_ids[0])
    return {"node_id": ctx.get_node_id(), "pid": os.getpid(), "gpu_ids": gpu_ids,
            "device": device, "gpu_uuid": uuid}


def _uuid_by_ray_gpu_id(gpu_id) -> Optional[str]:
    try:
        idx = int(gpu_id)
    except (TypeError, ValueError):
        return _norm_uuid(gpu_id) if str(gpu_id).startswith(("GPU-", "MIG-")) else None
    for g in gpu_inventory():
        if g["index"] == idx:
            return g["uuid"]
    return None


# ---- the helper actor ---------------------------------------------------------------------------

# A tiny watchdog process (plain interpreter in isolated mode, detached: it double-forks into its
# own session, so neither signals to the helper's process group nor Ray's killing of a dead
# worker's child processes reach it). The helper tells it which names it holds ("+name" / "-name"
# lines on its stdin); when the helper goes away for any reason, SIGKILL included, the pipe reaches
# EOF and the watchdog unlinks whatever the helper still held, then exits.
_REAPER = r"""
import os, re, sys
if os.fork() > 0:
    os._exit(0)
os.setsid()
sys.stdout.write(f"{os.getpid()}\n")
sys.stdout.flush()
sys.stdout.close()
os.close(1)
ok = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,200}")
d, held = sys.argv[1], set()
for line in sys.stdin:
    line = line.strip()
    if ok.fullmatch(line[1:]):
        (held.add if line[:1] == "+" else held.discard)(line[1:])
for n in held:
    try:
        os.unlink(os.path.join(d, n))
    except OSError:
        pass
"""


class _Reaper:
    def __init__(self):
        self._stdin = None
        self.pid = None
        try:
            p = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _REAPER, SHM_DIR], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True, text=True)
            self.pid = int(p.stdout.readline())
            p.stdout.close()
            p.wait(timeout=30)           # the intermediate process exits at once
            self._stdin = p.stdin
        except Exception:
            self._stdin = None

    def tell(self, sign: str, names) -> None:
        if self._stdin is None or not names:
            return
        try:
            self._stdin.write("".join(f"{sign}{n}\n" for n in names))
            self._stdin.flush()
        except Exception:
            pass

    def alive(self) -> bool:
        if self._stdin is None or self.pid is None:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            pass
        return True


def _unlink_all(names) -> None:
    for n in list(names):
        try:
            ShmRing.unlink(n)
        except Exception:
            pass


@ray.remote(num_cpus=0)
class NodeHelper:
    """See the module docstring. Methods run one at a time (a plain synchronous actor)."""

    def __init__(self):
        self._node_id = ray.get_runtime_context().get_node_id()
        self._groups: Dict[str, List[str]] = {}
        self._linked: set = set()            # names this helper created and has not unlinked
        self._topology: Optional[dict] = None
        # Cleanup of names not yet sealed: the finalizer on a graceful exit (it also runs at
        # interpreter exit), the reaper process whatever the cause (SIGKILL, ray.kill, node OOM).
        self._reaper = _Reaper()
        self._finalizer = weakref.finalize(self, _unlink_all, self._linked)

    def ping(self) -> str:
        return self._node_id

    def topology(self) -> dict:
        if self._topology is None:
            self._topology = node_topology(self._node_id)
        return dict(self._topology)

    def create_rings(self, group_id: str, count: int, slot_bytes: int, slots: int = 2,
                     gpu: bool = False) -> List[str]:
        """Create `count` rings of `slots` x `slot_bytes` and return their names.

        gpu=False: ShmRing segments (the slots are in the segment). gpu=True: CudaIpcRing header
        segments (a few KiB; the receiver allocates the slots on its GPU; no GPU needed here).
        The helper does not keep them mapped: the names (and the memory) stay until seal()."""
        if gpu:
            from .transport.cuda_ipc import CudaIpcRing as ring_cls
        else:
            ring_cls = ShmRing
        names = []
        try:
            for _ in range(int(count)):
                ring = ring_cls.create(int(slot_bytes), int(slots))
                self._linked.add(ring.name)
                names.append(ring.name)
                self._reaper.tell("+", [ring.name])
                ring.close()
        except BaseException:
            self._forget(names)
            raise
        self._groups.setdefault(group_id, []).extend(names)
        return names

    def seal(self, group_id: str) -> None:
        """Unlink the group's names. Call once every rank has attached: their mappings stay valid
        (and are the only thing keeping the memory), later attaches fail."""
        self._forget(self._groups.get(group_id, []))

    def destroy_group(self, group_id: str) -> None:
        """Unlink whatever is left of the group and forget it (idempotent)."""
        self._forget(self._groups.pop(group_id, []))

    def _forget(self, names) -> None:
        names = [n for n in names if n in self._linked]
        _unlink_all(names)
        self._linked.difference_update(names)
        self._reaper.tell("-", names)

    def segments(self, group_id: Optional[str] = None) -> List[str]:
        """Names this helper still has linked (that still exist), optionally of one group."""
        names = self._linked if group_id is None else \
            [n for n in self._groups.get(group_id, []) if n in self._linked]
        return sorted(n for n in names if segment_exists(n))

    def groups(self) -> List[str]:
        return sorted(self._groups)

    def reaper_alive(self) -> bool:
        return self._reaper.alive()

    def __del__(self):
        try:
            _unlink_all(self._linked)
        except Exception:
            pass


def start_node_helpers(node_ids: List[str], name_prefix: Optional[str] = None, *,
                       runtime_env: Optional[dict] = None,
                       domains: Optional[Mapping[str, str]] = None,
                       namespace: Optional[str] = None,
                       timeout_s: Optional[float] = 120.0) -> Dict[str, Any]:
    """Start one NodeHelper on each node (hard node affinity, 0 CPUs); {node id: handle}.

    name_prefix: name the helpers ``f"{name_prefix}-{node_id}"`` (named, not detached: they still
        end with the job) and reuse one that already exists under that name.
    runtime_env: the helpers' runtime env (e.g. ``{"env_vars": {"RAY_RESHARD_DOMAIN": "x"}}``).
    domains: node id -> domain, merged into each helper's env as RAY_RESHARD_DOMAIN (overrides
        NVML discovery; lets a test simulate several NVLink domains).
    timeout_s: wait that long for every helper to answer a ping (None: do not wait).
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    handles: Dict[str, Any] = {}
    for node_id in dict.fromkeys(node_ids):
        env = dict(runtime_env or {})
        if domains and node_id in domains:
            env_vars = dict(env.get("env_vars") or {})
            env_vars[DOMAIN_ENV] = str(domains[node_id])
            env["env_vars"] = env_vars
        opts: Dict[str, Any] = {
            "num_cpus": 0,
            "num_gpus": 0,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            "max_restarts": 0,
        }
        if env:
            opts["runtime_env"] = env
        if name_prefix:
            opts["name"] = f"{name_prefix}-{node_id}"
            opts["get_if_exists"] = True
            if namespace is not None:
                opts["namespace"] = namespace
        handles[node_id] = NodeHelper.options(**opts).remote()
    if timeout_s is not None and handles:
        got = ray.get([h.ping.remote() for h in handles.values()], timeout=timeout_s)
        for node_id, answered in zip(handles, got):
            if answered != node_id:
                raise RuntimeError(f"node helper for {node_id} runs on {answered}")
    return handles
