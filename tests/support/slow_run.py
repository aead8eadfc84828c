"""``mlx-tier`` with its model made slow on purpose, run in a subprocess by
tests/job/test_signals.py (not a test module itself).

``SLOW_KIND=sleep``: prompt calls sleep 0.04 s per token, spread over the
decoder layers (25 prompt tokens/s, as slow as a big MoE on a 2-core CPU). ``SLOW_KIND=mlx``: the first
prompt call after the shared prefix runs one long MLX computation (a chain
of 2048x2048 matmuls, minutes on this CPU) inside ``mx.eval``, where Python
cannot run signal handlers; ``SLOW_MARKER`` is created when it starts.
``SLOW_KIND=decode``: every decode step sleeps 2 s (a summary being written
takes minutes, as near a memory limit).
"""

import os
import sys
import time

import mlx.core as mx

import mlx_tier.engine.load as tiered

_load = tiered.load


def _slow_layers(model) -> None:
    """Each decoder layer sleeps its share of 0.04 s per prompt token (rows times
    tokens over the layers), so a prompt step is slow inside the layers, as a big
    MoE's is: a stop asked between layers is seen within one layer's time."""
    layers = model.layers
    for layer in layers:
        cls = type(layer)

        def call(self, x, *a, _cls=cls, **k):
            if x.shape[1] > 1:
                time.sleep(0.04 * x.shape[0] * x.shape[1] / len(layers))
            return _cls.__call__(self, x, *a, **k)

        layer.__class__ = type(f"Slow{cls.__name__}", (cls,), {"__call__": call})


def load(*args, **kwargs):
    model, tokenizer = _load(*args, **kwargs)
    cls, calls = type(model), [0]
    if os.environ["SLOW_KIND"] == "sleep":
        _slow_layers(model)

    def call(self, inputs, *a, **k):
        if os.environ["SLOW_KIND"] == "decode" and inputs.shape[1] == 1:
            time.sleep(2.0)  # every decode step: a summary of 40 tokens takes 80 s
        elif inputs.shape[1] > 1:
            calls[0] += 1
            if calls[0] > 1 and os.environ["SLOW_KIND"] == "mlx":
                open(os.environ["SLOW_MARKER"], "w").close()
                x = mx.random.normal((2048, 2048))
                y = x
                for _ in range(40):
                    y = y @ x
                mx.eval(y)
        return cls.__call__(self, inputs, *a, **k)

    model.__class__ = type("SlowModel", (cls,), {"__call__": call})
    return model, tokenizer


tiered.load = load

if __name__ == "__main__":
    from mlx_tier.cli.main import main

    sys.argv = ["mlx-tier", *sys.argv[1:]]
    main()
