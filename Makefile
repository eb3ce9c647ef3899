# One venv in .venv; every target installs what it needs first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install extras demo imagenet-sample test test-all test-multihost bench bench-full bench-mpi bench-multihost proto clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py $(wildcard cext/*.pyx cext/*.pxd cext/*.pxi cext/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# build requirements into the venv itself: rebuilds after a .pyx edit then take seconds
	$(PY) -m pip install -q 'setuptools>=70' wheel 'cython>=3.0' 'numpy>=2.0' 'scipy>=1.11'
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'
	touch $(STAMP)

# The optional extras by name (pip install 'caffepy[draw,hdf5,plot,onnx]'): pydot for
# caffe.draw.get_pydot_graph, h5py for HDF5 layers and snapshots, matplotlib for plot_log,
# onnx for export_onnx.
# Drawing nets also needs Graphviz's `dot` program: apt-get install graphviz.
# Their requirements are read from the installed caffepy's metadata (pyproject.toml's
# optional-dependencies) and installed alone: reinstalling caffepy would recompile every kernel.
EXTRAS := $(VENV)/.extras

define EXTRA_REQUIREMENTS
import importlib.metadata as m
for r in m.requires("caffepy"):
    spec, _, marker = r.partition(";")
    if any(f'extra == "{e}"' in marker for e in ("draw", "hdf5", "plot", "onnx")):
        print(spec.strip())
endef
export EXTRA_REQUIREMENTS

extras: $(EXTRAS)

$(EXTRAS): $(STAMP)
	$(PY) -c "$$EXTRA_REQUIREMENTS" | xargs $(PY) -m pip install -q
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
	$(PY) -m pip install -q torch==2.13.0 || echo "torch unavailable: torch-reference tests will skip"
	touch $(TORCH)

# the extras too, so their tests run rather than skip
test: install $(EXTRAS) $(TORCH)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q

# Includes the slow end-to-end runs
test-all: install $(EXTRAS) $(TORCH)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q -m ''

# Ranks across emulated hosts (network namespaces + veth, root needed; skipped with the
# reason where the machine does not allow it). Not in `make test`: CI runs both.
test-multihost: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q -m multihost tests/multihost

bench: install $(TORCH)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) benchmarks/bench_alexnet.py

bench-full: install $(TORCH)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) benchmarks/bench_alexnet.py --full

bench-mpi: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) benchmarks/bench_mpi.py

# 2 emulated hosts, 500 Mbit/s link: how much of the gradient allreduce hides (root needed)
bench-multihost: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) benchmarks/bench_multihost.py

# Regenerate caffepy/proto/caffe_pb2.py after editing caffe.proto
proto: install
	$(PY) -m pip install -q grpcio-tools==1.85.1
	$(PY) -m grpc_tools.protoc -Icaffepy/proto --python_out=caffepy/proto caffepy/proto/caffe.proto

# The stamp too: the next target rebuilds the kernels it removes
clean:
	rm -rf build *.egg-info caffepy/kernels/*.so cext/*.c $(STAMP)
