"""Upstream OpenTinker's client utilities (github.com/open-tinker/OpenTinker):

    http_training_client.py  SchedulerClient, ServiceClient, InferenceSchedulerClient
    config.py                upstream client config keys -> JobSpec (job_spec_from_config)
"""
