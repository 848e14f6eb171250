import os
import sys

from .main import main

code = main()
sys.stdout.flush()
sys.stderr.flush()
# Skip interpreter teardown: TensorFlow's and Gloo's native threads can abort
# while Python unloads modules, turning a clean finish into a crash report.
os._exit(code)
