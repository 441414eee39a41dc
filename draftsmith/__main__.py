from draftsmith.cli import main

if __name__ == "__main__":  # spawned worker processes import __main__ again: never re-run the CLI there
    main()
