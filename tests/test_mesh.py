"""The device mesh: a mesh smaller than the devices takes the first ones in one process, never over several."""

import jax
import pytest

from finetune.step import mesh as mesh_module
from finetune.step.mesh import MeshError, make_mesh

NOTE = ("finetune-lora: note: the mesh uses 2 of the 8 visible devices; HIP_VISIBLE_DEVICES (ROCm) or "
        "CUDA_VISIBLE_DEVICES (CUDA) chooses which are visible (JAX reserves memory on every visible GPU, used or not)")


@pytest.fixture(autouse=True)
def fresh_note():
    """The note is printed once per process: each test starts as a new process would."""
    mesh_module._note_unused_devices.cache_clear()


def test_a_smaller_mesh_takes_the_first_devices_and_says_so_once(capsys):
    mesh = make_mesh("dp=1,fsdp=2,mp=1")
    assert list(mesh.devices.flat) == jax.devices()[:2]
    assert dict(mesh.shape) == {"dp": 1, "fsdp": 2, "cp": 1, "mp": 1}
    make_mesh("dp=1,fsdp=1,cp=2,mp=1")  # --fit plans several meshes over the same devices
    assert capsys.readouterr().err.splitlines() == [NOTE]


def test_a_mesh_of_every_device_says_nothing(capsys):
    assert make_mesh("dp=2,fsdp=-1,mp=1").devices.size == 8
    assert capsys.readouterr().err == ""


def test_a_smaller_mesh_over_several_processes_is_one_line_error(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(MeshError) as error:
        make_mesh("dp=1,fsdp=2,mp=1")
    assert str(error.value) == (
        "--mesh 'dp=1,fsdp=2,mp=1' names 2 of the 8 devices of this 2-process run; several processes must use every "
        "device: choose each process's devices with HIP_VISIBLE_DEVICES (ROCm) or CUDA_VISIBLE_DEVICES (CUDA)")


def test_a_mesh_larger_than_the_devices_is_an_error():
    with pytest.raises(MeshError, match=r"dp x fsdp x cp x mp = 2x8x1x1 = 16 devices, but 8 are available"):
        make_mesh("dp=2,fsdp=8,mp=1")
