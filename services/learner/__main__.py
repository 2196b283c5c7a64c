from opentinker.services.learner.service import main

if __name__ == "__main__":
    main()
