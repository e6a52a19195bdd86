"""The Containerfiles read statically (the CUDA image cannot be built without its base images
and a CUDA toolchain): one CUDA major for the base images, torch, cupy and NCCL, a bounded
GPU arch list for the kernels compiled in the image, and a CPU image whose dependencies sit
in a layer of their own before the sources, with every package the project installs."""
from __future__ import annotations

import re
import tomllib

from tests.deploy.chart import ROOT

CUDA = (ROOT / "k8s" / "Containerfile.cuda").read_text()
CPU = (ROOT / "k8s" / "Containerfile.cpu").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# the CUDA major of PyPI's default (manylinux x86_64) torch wheel, by torch version: PyPI
# serves one CUDA build per release, and its nvidia-* dependencies (NCCL among them) follow it
PYPI_TORCH_CUDA_MAJOR = {"2.13.0": 13}


def arg(text: str, name: str) -> str:
    return re.search(rf"^ARG {name}=\"?([^\"\n]+)\"?$", text, re.M).group(1)


def logical_lines(text: str) -> list[str]:
    return [line.strip() for line in text.replace("\\\n", " ").splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_the_cuda_image_uses_one_cuda_major_throughout():
    devel, runtime = arg(CUDA, "CUDA_DEVEL"), arg(CUDA, "CUDA_RUNTIME")
    tag = re.compile(r"nvidia/cuda:(\d+)\.(\d+)\.(\d+)-cudnn-(devel|runtime)-")
    assert tag.search(devel).group(4) == "devel" and tag.search(runtime).group(4) == "runtime"
    assert tag.search(devel).groups()[:3] == tag.search(runtime).groups()[:3], (devel, runtime)
    base_major = int(tag.search(devel).group(1))

    (torch_line,) = [line for line in logical_lines(CUDA) if re.search(r"pip install torch==", line)]
    version = re.search(r"torch==([0-9.]+)", torch_line).group(1)
    assert version == re.search(r"torch==([0-9.]+)", " ".join(
        PYPROJECT["project"]["dependencies"])).group(1)        # the version the project pins
    index = re.search(r"--(?:index-url|extra-index-url)[= ](\S+)", torch_line)
    if index:                                   # download.pytorch.org/whl/cuXYZ
        torch_major = int(re.search(r"/cu(\d+?)\d$", index.group(1).rstrip("/")).group(1))
    else:
        torch_major = PYPI_TORCH_CUDA_MAJOR[version]
    assert torch_major == base_major, (torch_major, base_major)
    # the build stops if the torch it installed was built for another major
    assert int(arg(CUDA, "CUDA_MAJOR")) == base_major
    assert "torch.version.cuda" in torch_line and "CUDA_MAJOR" in torch_line

    (cupy,) = [d for d in PYPROJECT["project"]["optional-dependencies"]["gpu"]
               if d.startswith("cupy")]
    assert cupy == f"cupy-cuda{base_major}x", cupy
    assert "'.[gpu]'" in CUDA


def test_the_cuda_image_compiles_kernels_for_a_bounded_arch_list():
    archs = arg(CUDA, "TORCH_CUDA_ARCH_LIST").split(";")
    assert 1 <= len(archs) <= 4, archs
    for a in archs:
        assert re.fullmatch(r"\d+\.\d", a) and float(a) >= 7.5, a   # CUDA 13 starts at Turing
    flash = arg(CUDA, "FLASH_ATTN_CUDA_ARCHS").split(";")
    assert flash == [a.replace(".", "") for a in archs]
    env = " ".join(l for l in logical_lines(CUDA) if l.startswith("ENV "))
    assert "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}" in env
    assert "FLASH_ATTN_CUDA_ARCHS=${FLASH_ATTN_CUDA_ARCHS}" in env


def test_the_cpu_image_builds_from_a_base_argument_with_dependencies_before_sources():
    lines = logical_lines(CPU)
    assert lines[0].startswith("ARG BASE=")
    assert [l for l in lines if l.startswith("FROM")] == ["FROM ${BASE} AS build", "FROM ${BASE}"]
    build = lines[:lines.index("FROM ${BASE}")]
    deps = next(i for i, l in enumerate(build) if "pip install -r" in l)
    copies = [i for i, l in enumerate(build) if l.startswith("COPY") and "pyproject" not in l]
    assert copies and deps < min(copies)           # a source change keeps the dependency layer
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {re.match(r"COPY (\S+) ", build[i]).group(1) for i in copies}
    assert packages <= copied, packages - copied    # loadtest/ included
    final = " ".join(lines[lines.index("FROM ${BASE}"):])
    assert re.search(r"apt-get install [^&]*\bg\+\+", final)   # torch's --compile needs C++
    assert "USER 1000" in final
