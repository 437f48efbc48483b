"""Publishing builds to a store (a folder or the Hugging Face Hub) and fetching them back verified."""
