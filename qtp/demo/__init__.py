"""The show cases, apart from the product: ``python -m qtp.demo`` (what ``make demo`` runs: two nodes, an order
stream, a server SIGKILLed midway, exactly-once checked), ``qtp.demo.shop`` (its server node's handlers) and
``python -m qtp.demo.transfers`` (bank transfers across PostgreSQL and MariaDB in global transactions)."""
