# jupyter-tfdist: TensorFlow's import-time log lines held to TF_CPP_MIN_LOG_LEVEL (absl ignores it before it
# is initialised: oneDNN's notice on AVX-512/AMX CPUs under every first cell). See tfdist.tfquiet.
try:
    import tfdist.tfquiet as _tfdist_tfquiet

    _tfdist_tfquiet.install()
    del _tfdist_tfquiet
except Exception:  # a kernel starts whatever happens here
    pass
