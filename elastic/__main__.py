from elastic.cli import main

main()
