from denv_iac.cli import main

main()
