"""Test double of what `import tensorflow` writes on file descriptor 2 on a CPU with AVX-512 or AMX
(TensorFlow 2.21: absl before its initialisation, deaf to TF_CPP_MIN_LOG_LEVEL; see tfdist.tfquiet), plus
an error line, which must still reach the cell. Lets the kernel test run on any CPU, fast."""

import contextlib
import os

with contextlib.suppress(OSError):  # no fd 2: TensorFlow's own writes fail silently too
    os.write(
        2,
        b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
        b"I0000 00:00:1796149594.761801    5449 port.cc:153] oneDNN custom operations are on. You may see "
        b"slightly different numerical results due to floating-point round-off errors from different "
        b"computation orders. To turn them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.\n"
        b"E0000 00:00:1796149594.861801    5449 fake_tensorflow.cc:7] an error TensorFlow reports\n",
    )
__version__ = "0.0-test-double"
