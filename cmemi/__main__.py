from cmemi.cli import main

main()
