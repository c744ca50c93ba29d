"""Put on PYTHONPATH of a real `opd` process by the reliability tests: installs the read tracer
(tests/reliability/tracer.py) before anything imports stages, transformers or safetensors."""
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_here))
import tracer  # noqa: E402

tracer.install()
sys.path.remove(os.path.dirname(_here))
