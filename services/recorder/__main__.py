from opentinker.services.recorder.service import main

if __name__ == "__main__":
    main()
