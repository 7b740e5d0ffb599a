from denv_agent.cli import main

raise SystemExit(main())
