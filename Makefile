# One venv in .venv; every target installs what it needs first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install extras demo imagenet-sample test test-all test-pycaffe test-multihost bench bench-quick bench-full bench-layers bench-inference bench-threads bench-int8 bench-bf16 bench-bf16-speed bench-mpi bench-multihost proto clean

install: $(STAMP)

PIP := $(PY) -m pip install -q --disable-pip-version-check --no-compile

# What caffepy itself needs, no more: `make demo` waits for this alone. The kernels compile one
# job per core (setup.py); the build requirements go into the venv itself, so rebuilds after a
# .pyx edit take seconds. --no-compile: Python compiles a module when it is first imported
# rather than pip compiling all of numpy's and scipy's up front (two thirds of pip's CPU time).
# caffepy's other requirements (OpenCV, MPICH, ...) download and install in the background
# meanwhile, none of them needed to build; `pip check` then confirms nothing is missing
$(STAMP): pyproject.toml setup.py $(wildcard cext/*.pyx cext/*.pxd cext/*.pxi cext/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "$$RUNTIME_REQUIREMENTS" > $(VENV)/.runtime-requirements
	set -e; nodeps=; \
	if [ -s $(VENV)/.runtime-requirements ]; then \
	  $(PIP) --no-deps -r $(VENV)/.runtime-requirements & deps=$$!; nodeps=--no-deps; \
	fi; \
	$(PIP) 'setuptools>=70' wheel 'cython>=3.1' 'numpy>=2.0' 'scipy>=1.11'; \
	$(PIP) --no-build-isolation $$nodeps -e .; \
	if [ -n "$$nodeps" ]; then wait $$deps; fi
	$(PY) -m pip check
	touch $(STAMP)

# caffepy's requirements but numpy and scipy (the build's own), from pyproject.toml; tomllib is
# Python 3.11's: on 3.10 none, and pip installs them with caffepy, one after the other
define RUNTIME_REQUIREMENTS
import re
try:
    import tomllib
except ImportError:
    raise SystemExit
for r in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    if not re.match(r"(numpy|scipy)\b", r):
        print(r)
endef
export RUNTIME_REQUIREMENTS

# Requirements of optional extras, read from the installed caffepy's metadata (pyproject.toml's
# optional-dependencies) and installed alone: reinstalling caffepy would recompile every kernel.
# Usage: $(PY) -c "$$EXTRA_REQUIREMENTS" extra [extra ...]
define EXTRA_REQUIREMENTS
import importlib.metadata as m, sys
for r in m.requires("caffepy"):
    spec, _, marker = r.partition(";")
    if any(f'extra == "{e}"' in marker for e in sys.argv[1:]):
        print(spec.strip())
endef
export EXTRA_REQUIREMENTS

# The test extra (pytest; onnx and onnxruntime for the export checks; six for BVLC's suite): only
# for the test targets
TESTDEPS := $(VENV)/.testdeps

$(TESTDEPS): $(STAMP)
	$(PY) -c "$$EXTRA_REQUIREMENTS" test | xargs $(PIP)
	touch $(TESTDEPS)

# The optional extras by name (pip install 'caffepy[draw,hdf5,plot,onnx,tensorboard]'): pydot
# for caffe.draw.get_pydot_graph, h5py for HDF5 layers and snapshots, matplotlib for plot_log,
# onnx for export_onnx, tensorboardX for train --tensorboard.
# Drawing nets also needs Graphviz's `dot` program: apt-get install graphviz.
EXTRAS := $(VENV)/.extras

extras: $(EXTRAS)

$(EXTRAS): $(STAMP)
	$(PY) -c "$$EXTRA_REQUIREMENTS" draw hdf5 plot onnx tensorboard | xargs $(PIP)
	touch $(EXTRAS)

# The embedded default: digits -> LMDB -> train LeNet -> test accuracy
demo: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash examples/digits/run.sh

# A synthetic stand-in for ImageNet at the paths models/intel_alexnet and mpi_intel_alexnet
# name: 500 generated JPEGs in 10 classes -> caffepy convert_imageset (256 x 256) -> train/val
# LMDBs in examples/imagenet/, and the mean in data/ilsvrc12/ (about 100 MB; keeps real LMDBs)
imagenet-sample: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) examples/imagenet/make_sample.py

# torch (a local CPU build) is only a test-time reference; without it those checks skip
TORCH := $(VENV)/.torch

$(TORCH): $(STAMP)
	$(PIP) torch==2.13.0 || echo "torch unavailable: torch-reference tests will skip"
	touch $(TORCH)

# the extras too, so their tests run rather than skip
test: install $(TESTDEPS) $(EXTRAS) $(TORCH)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q

# Includes the slow end-to-end runs
test-all: install $(TESTDEPS) $(EXTRAS) $(TORCH)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q -m ''

# BVLC Caffe's own pycaffe suite (python/caffe/test) against caffepy as `caffe`, read at test time
# from a BVLC checkout: make test-pycaffe CAFFEPY_BVLC_CAFFE=/path/to/caffe (a work tree or a git
# directory); skipped, with the reason, without one
test-pycaffe: install $(TESTDEPS)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q -rs tests/test_pycaffe_suite.py

# Ranks across emulated hosts (network namespaces + veth, root needed; skipped with the
# reason where the machine does not allow it). Not in `make test`: CI runs both.
test-multihost: install $(TESTDEPS)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q -m multihost tests/multihost

# The training table, net by net: caffepy, PyTorch (torch, a test-time reference) and BVLC
# Caffe when CAFFE_BIN names its `caffe` binary; efficiency, sgemm peak, peak RSS; the threading
# check. Every net at its default batch (VGG-16 at 4), 3 rounds. BENCH_ARGS passes more
# options (python benchmarks/bench_nets.py --help), e.g. make bench BENCH_ARGS='--nets resnet50'
bench: install $(TORCH)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) benchmarks/bench_nets.py $(BENCH_ARGS)

# LeNet, cifar10_quick and AlexNet, 2 rounds
bench-quick: install $(TORCH)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) benchmarks/bench_nets.py --quick $(BENCH_ARGS)

# Larger batches (AlexNet 256, ResNet-50 / GoogLeNet / MobileNet 32, VGG-16 16), 5 rounds
bench-full: install $(TORCH)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) benchmarks/bench_nets.py --full $(BENCH_ARGS)

# Single layers, every implementation of each, beside PyTorch's (benchmarks/bench_layers.py)
bench-layers: install $(TORCH)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) benchmarks/bench_layers.py $(BENCH_ARGS)

# Deployment: the TEST net's forward in caffepy, ONNX Runtime (the test extra) and OpenVINO f32
# on the ONNX file caffepy exports, GoogLeNet / AlexNet / ResNet-50 at batch 1 and 16
# (BENCH_ARGS='--nets all' adds MobileNet and VGG-16). OpenVINO is a benchmark-time reference:
# it goes into .benchdeps/openvino (pip --target), never into the venv. OpenBLAS's kernel
# overrides are unset for every contender alike.
OPENVINO := .benchdeps/openvino/.installed

$(OPENVINO): $(STAMP)
	mkdir -p $(dir $(OPENVINO))
	$(PY) -m pip install -q --target $(dir $(OPENVINO)) openvino==2026.4.1 \
		|| echo "openvino unavailable: the table leaves it out"
	touch $(OPENVINO)

bench-inference: install $(EXTRAS) $(OPENVINO)
	env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE PATH="$(CURDIR)/$(VENV)/bin:$$PATH" \
		$(PY) benchmarks/bench_inference.py $(BENCH_ARGS)

# Default threads vs one thread (idle, and beside a busy process it starts) on LeNet, CIFAR-10,
# the digits demo's net and AlexNet b4; with CAFFE_BIN=/path/to/caffe, BVLC Caffe's `caffe time` too
bench-threads: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) benchmarks/bench_threads.py

# int8 (quantization_param) against float32: Intel's int8 ResNet-50, MobileNet v1, Inception-v3
# and GoogLeNet calibrated here, forward at batch 1 and 16 (CAFFEPY_INTEL_CAFFE names an Intel
# Caffe tree with models/), beside OpenVINO's default precision (installed as for
# bench-inference), then caffepy calibrate's accuracy on LeNet, a CIFAR-style net and a small
# ResNet trained on the digits
bench-int8: install $(EXTRAS) $(OPENVINO)
	env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE PATH="$(CURDIR)/$(VENV)/bin:$$PATH" \
		$(PY) benchmarks/bench_int8.py $(BENCH_ARGS)

# bf16's accuracy against float32 (on the bf16 kernels where the CPU has them, else emulated):
# LeNet, a CIFAR-style net and a small ResNet trained on the bundled digits; bf16 inference,
# and the ResNet trained in bf16
bench-bf16: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) benchmarks/bench_bf16.py $(BENCH_ARGS)

# bf16's speed against float32: forward at batch 1 and 16 and a training iteration, alternating
bench-bf16-speed: install
	env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE PATH="$(CURDIR)/$(VENV)/bin:$$PATH" \
		$(PY) benchmarks/bench_bf16_speed.py $(BENCH_ARGS)

bench-mpi: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) benchmarks/bench_mpi.py

# 2 emulated hosts, 500 Mbit/s links: how much of the gradient allreduce `mpiexec caffepy train`
# hides (1 rank per host, float32 and bfloat16 wires; 2 ranks per host, hierarchical and flat
# ring), then the in-process harness at 2 and 4 hosts, the scaling model against the measured
# iterations; then the model with stragglers and topology at 2, 4, 8 hosts and 2 x 2 ranks,
# You et al.'s 1024-CPU point and the projection (root needed)
bench-multihost: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) benchmarks/bench_multihost.py --per-host 1,2 --wire --validate --hybrid
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) benchmarks/bench_scaling_model.py

# Regenerate caffepy/proto/caffe_pb2.py after editing caffe.proto
proto: install
	$(PY) -m pip install -q grpcio-tools==1.85.1
	$(PY) -m grpc_tools.protoc -Icaffepy/proto --python_out=caffepy/proto caffepy/proto/caffe.proto

# The stamp too: the next target rebuilds the kernels it removes
clean:
	rm -rf build *.egg-info caffepy/kernels/*.so caffepy/kernels/avx512 cext/*.c $(STAMP) $(TESTDEPS)
