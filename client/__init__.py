"""Upstream OpenTinker's client API on this service (github.com/open-tinker/OpenTinker,
`opentinker/client/`): its scripts' `SchedulerClient`, `ServiceClient` and
`InferenceSchedulerClient` from `opentinker.client.utils.http_training_client`, and its
config keys mapped to our JobSpec (`client/utils/config.py`). Re-exports nothing, as
upstream's package does.
"""
