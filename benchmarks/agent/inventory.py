"""A small inventory of parts, with reorder levels."""
from dataclasses import dataclass, field


@dataclass
class Item:
    sku: str
    name: str
    quantity: int = 0
    reorder_level: int = 5
    tags: list[str] = field(default_factory=list)

    def needs_reorder(self) -> bool:
        return self.quantity <= self.reorder_level


class Inventory:
    def __init__(self):
        self.items: dict[str, Item] = {}

    def add(self, item: Item) -> None:
        if item.sku in self.items:
            raise ValueError(f"duplicate sku {item.sku}")
        self.items[item.sku] = item

    def remove(self, sku: str) -> Item:
        return self.items.pop(sku)

    def receive(self, sku: str, count: int) -> int:
        item = self.items[sku]
        item.quantity += count
        return item.quantity

    def ship(self, sku: str, count: int) -> int:
        item = self.items[sku]
        if count > item.quantity:
            raise ValueError(f"only {item.quantity} of {sku} in stock")
        item.quantity -= count
        return item.quantity

    def to_reorder(self) -> list[Item]:
        return [item for item in self.items.values() if item.needs_reorder()]

    def total_units(self) -> int:
        return sum(item.quantity for item in self.items.values())
