"""Upstream OpenTinker's client utilities (github.com/open-tinker/OpenTinker):

    http_training_client.py        SchedulerClient, ServiceClient, InferenceSchedulerClient
    config.py                      upstream client config keys -> JobSpec (job_spec_from_config)
    utils.py                       resolve_paths_in_config, find_free_port, ...
    scheduler_client_lifecycle.py  get_lifecycle_manager: the job ends when the script does

Upstream's scripts import these as `utils.<module>` (they run from its client folder):
`opentinker upstream SCRIPT [overrides]` runs such a script with `utils` bound
to this package (client/run_script.py).
"""
