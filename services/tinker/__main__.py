from opentinker.services.tinker.service import main

if __name__ == "__main__":
    main()
