from opentinker.services.scheduler.service import main

if __name__ == "__main__":
    main()
