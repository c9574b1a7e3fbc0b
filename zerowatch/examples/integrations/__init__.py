"""Copy-paste examples of the Trainer, Lightning and Accelerate integrations (docs/integrations.md); the tests run them."""
