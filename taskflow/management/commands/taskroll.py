from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

from taskflow.engine.rolling import RollError, roll


class Command(BaseCommand):
    help = (
        "Move old finished tasks into numbered history tables, start the next table when one is full, "
        "and drop history tables past retention (docs/rolling.md)."
    )

    def add_arguments(self, parser) -> None:  # noqa: ANN001
        parser.add_argument("--dry-run", action="store_true", help="print what would be done and change nothing")

    def handle(self, *args, **options) -> None:  # noqa: ANN002, ANN003
        try:
            result = roll(dry_run=options["dry_run"])
        except (RollError, DatabaseError) as exc:
            raise CommandError(f"roll failed, nothing of the failed batch changed: {exc}") from None
        self.stdout.write(str(result))
