"""Framework integrations, each imported only once its framework is (see ``layers.find_mark``)."""
