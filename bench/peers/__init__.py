"""splitstack against HF transformers and llama.cpp on one checkpoint, each engine in its
own worker process (`python -m bench.peers.run`)."""
