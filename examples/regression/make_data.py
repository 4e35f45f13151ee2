"""Write houses.csv: 1,000 made-up house sales and their prices, the same file every time.

    python make_data.py            # writes houses.csv next to this file

Columns: size_m2, age_years, rooms, distance_km (to the city centre) and price (thousands,
one decimal). Three rows at the end are broken on purpose, as real exports are: ringflow
keeps them aside in the dataset's rejected.parquet, each with its reason, and trains on the
rest.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

ROWS = 1000
BAD_ROWS = [
    "n/a,12,3,4.5,310.0",  # size is not a number
    "85.0,-3,3,2.0,295.5",  # a negative age: outside HousePrice.data_defaults' bounds
    "120.0,30,4",  # too few fields
]
"""Appended after the good rows; ringflow rejects each of them."""


def price(size: float, age: int, rooms: int, distance: float, noise: float) -> float:
    """The made-up market: bigger, newer, more rooms and closer cost more."""
    return 40 + 2.6 * size - 1.1 * age + 9.0 * rooms - 5.5 * distance + noise


def rows(seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(ROWS):
        size = round(rng.uniform(28, 260), 1)
        rooms = max(1, min(9, round(size / 30 + rng.gauss(0, 0.8))))
        age = rng.randint(0, 90)
        distance = round(rng.uniform(0.3, 40), 1)
        value = price(size, age, rooms, distance, rng.gauss(0, 15))
        out.append(f"{size},{age},{rooms},{distance},{max(value, 30.0):.1f}")
    return out


def write(path: Path) -> Path:
    header = "size_m2,age_years,rooms,distance_km,price"
    path.write_text("\n".join([header, *rows(), *BAD_ROWS]) + "\n")
    return path


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("houses.csv")
    print(write(target))
