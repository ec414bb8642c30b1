from django.apps import apps
from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

ROLE_NAMES = ("worker", "producer", "operator", "viewer")  # taskflow.api.accounts.ROLES, without importing DRF


class Command(BaseCommand):
    help = (
        "Create an API user in a role's group (worker, producer, operator or viewer) and print its token, "
        "shown only this once (docs/api.md). With --rotate-token, give an existing user a new token instead."
    )

    def add_arguments(self, parser) -> None:  # noqa: ANN001
        parser.add_argument("username")
        parser.add_argument("--role", choices=ROLE_NAMES, help="what the user may do (required to create one)")
        parser.add_argument(
            "--rotate-token",
            action="store_true",
            help="the user exists: replace its token (the old one stops working) and print the new one",
        )

    def handle(self, *args, **options) -> None:  # noqa: ANN002, ANN003
        if not apps.is_installed("rest_framework.authtoken"):
            raise CommandError("the API's tokens need 'rest_framework.authtoken' in INSTALLED_APPS (docs/api.md)")
        from taskflow.api.accounts import AccountError, create_api_user, rotate_token

        username, role = options["username"], options["role"]
        try:
            if options["rotate_token"]:
                credential = rotate_token(username, role)
            elif role is None:
                raise CommandError("--role is required to create a user: worker, producer, operator or viewer")
            else:
                credential = create_api_user(username, role)
        except (AccountError, DatabaseError) as exc:
            raise CommandError(f"{exc} (nothing was changed)") from None
        what = f"created API user {username!r}" if not options["rotate_token"] else f"new token for {username!r}"
        if credential.role is not None:
            what += f", {credential.role.name}: may {credential.role.does}"
        # The token alone on stdout, so `TOKEN=$(manage.py createapiuser …)` takes just it.
        self.stderr.write(f"{what}. Its token, shown only this once:")
        self.stdout.write(credential.token)
