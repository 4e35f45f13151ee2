"""Built-in example models, written as ordinary Lightning modules."""

from ringflow.models.digits import DigitsClassifier, write_digits_csv

__all__ = ["DigitsClassifier", "write_digits_csv"]
