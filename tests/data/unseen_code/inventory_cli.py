"""Small command-line tool for keeping a stock list in a JSON file.

Usage examples::

    inventory_cli.py --db parts.json add M3-BOLT 250 --price 0.04 --bin A2
    inventory_cli.py --db parts.json remove M3-BOLT 40
    inventory_cli.py --db parts.json list --below 100
    inventory_cli.py --db parts.json report
"""

import argparse
import json
import os
import re
import sys
import tempfile

SKU_PATTERN = re.compile(r"^[A-Z0-9][A-Z0-9_-]{1,31}$")


class InventoryError(Exception):
    """Raised for bad input or an inconsistent inventory file."""


def load_items(path):
    if not os.path.exists(path):
        return {}
    with open(path, "r", encoding="utf-8") as handle:
        try:
            data = json.load(handle)
        except json.JSONDecodeError as exc:
            raise InventoryError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InventoryError(f"{path} must hold a JSON object at top level")
    return data


def save_items(path, items):
    """Write ``items`` next to ``path`` first, then swap it into place."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, scratch = tempfile.mkstemp(prefix=".inv-", suffix=".json",
                                   dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(items, handle, indent=2, sort_keys=True)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(scratch, path)
    except BaseException:
        if os.path.exists(scratch):
            os.unlink(scratch)
        raise


def checked_sku(raw):
    sku = raw.strip().upper()
    if not SKU_PATTERN.match(sku):
        raise InventoryError(f"invalid SKU {raw!r}")
    return sku


def cmd_add(items, args):
    sku = checked_sku(args.sku)
    if args.quantity <= 0:
        raise InventoryError("quantity to add must be positive")
    entry = items.setdefault(sku, {"qty": 0, "price": 0.0, "bin": ""})
    entry["qty"] += args.quantity
    if args.price is not None:
        if args.price < 0:
            raise InventoryError("price cannot be negative")
        entry["price"] = round(args.price, 4)
    if args.bin:
        entry["bin"] = args.bin
    return True


def cmd_remove(items, args):
    sku = checked_sku(args.sku)
    if sku not in items:
        raise InventoryError(f"unknown SKU {sku}")
    entry = items[sku]
    if args.quantity is None or args.quantity >= entry["qty"]:
        if args.quantity is not None and args.quantity > entry["qty"]:
            raise InventoryError(
                f"only {entry['qty']} of {sku} in stock, cannot take "
                f"{args.quantity}")
        del items[sku]
    else:
        entry["qty"] -= args.quantity
    return True


def cmd_list(items, args):
    rows = sorted(items.items())
    if args.below is not None:
        rows = [(k, v) for k, v in rows if v["qty"] < args.below]
    for sku, entry in rows:
        print(f"{sku:<20} {entry['qty']:>8} {entry.get('bin', ''):<6}")
    return False


def cmd_report(items, args):
    total_units = sum(e["qty"] for e in items.values())
    total_value = sum(e["qty"] * e.get("price", 0.0) for e in items.values())
    bins = {e.get("bin") or "(none)" for e in items.values()}
    print(f"SKUs:        {len(items)}")
    print(f"Units:       {total_units}")
    print(f"Stock value: {total_value:,.2f}")
    print(f"Bins used:   {', '.join(sorted(bins)) or '-'}")
    return False


def build_parser():
    parser = argparse.ArgumentParser(description="Manage a JSON inventory.")
    parser.add_argument("--db", default="inventory.json",
                        help="path of the inventory file")
    sub = parser.add_subparsers(dest="command", required=True)

    add = sub.add_parser("add", help="add stock for a SKU")
    add.add_argument("sku")
    add.add_argument("quantity", type=int)
    add.add_argument("--price", type=float)
    add.add_argument("--bin", default="")
    add.set_defaults(handler=cmd_add)

    rem = sub.add_parser("remove", help="take stock out, or drop a SKU")
    rem.add_argument("sku")
    rem.add_argument("quantity", type=int, nargs="?")
    rem.set_defaults(handler=cmd_remove)

    lst = sub.add_parser("list", help="print stock levels")
    lst.add_argument("--below", type=int, help="only rows under this qty")
    lst.set_defaults(handler=cmd_list)

    rep = sub.add_parser("report", help="print totals")
    rep.set_defaults(handler=cmd_report)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        items = load_items(args.db)
        if args.handler(items, args):
            save_items(args.db, items)
    except InventoryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
