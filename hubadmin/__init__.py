"""tfdist.hubadmin: the hub service for GPU admins (GPU-idle culling, the admin page, Prometheus metrics).

Run by JupyterHub as ``python -m tfdist.hubadmin`` (see `hubconfig.enable_gpu_admin`). This package's
`config` module is imported by the profiles model, so it stays free of tornado and JupyterHub imports.
"""
