"""The OpenTinker client SDK: submit jobs, follow their metrics, write environments.

Imports schemas and the NATS client only: never torch or vLLM.
"""

from opentinker.sdk.client import (
    AuthenticationError, Client, InferenceEndpoint, Job, JobFailed, SyncClient, SyncJob,
)
from opentinker.sdk.env import AbstractGame, StepResult

__all__ = ["AbstractGame", "AuthenticationError", "Client", "InferenceEndpoint", "Job", "JobFailed", "StepResult", "SyncClient", "SyncJob"]
