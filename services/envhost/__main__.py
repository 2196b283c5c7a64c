from opentinker.services.envhost.service import main

if __name__ == "__main__":
    main()
