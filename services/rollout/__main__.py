"""`python -m opentinker.services.rollout`: see service.py."""

from opentinker.services.rollout import service

if __name__ == "__main__":
    service.main()
